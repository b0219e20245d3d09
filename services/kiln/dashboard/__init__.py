"""``kiln dashboard``: a small read-only web page over kiln's own gRPC APIs (Compiler,
Deployments, Ledger; the board over NATS where readable), and ``kiln compilations report``'s
self-contained HTML. docs/design/dashboard.md has the contract; nothing here writes anything."""
