#!/usr/bin/env bash
# Prints the Secrets deploy/k8s expects, as YAML for `kubectl apply`; nothing is committed:
#
#   deploy/k8s/make-secrets.sh --pki ./kiln-pki --trial | kubectl apply -n kiln -f -
#   deploy/k8s/make-secrets.sh --pki ./kiln-pki --database-url "$URL" | kubectl apply -n kiln -f -
#
#   kiln-tls-<service>  ca.pem, cert.pem, key.pem of services/<service> (each pod mounts its own)
#   kiln-nats           a password per NATS user (ledger, engine-pool, agent-runner, cost-model,
#                       cli, operator): random hex
#   kiln-database       url (KILN_DATABASE_URL); with --trial also postgres-password, for the
#                       trial overlay's PostgreSQL, and the url pointing at it
#
# --pki DIR is the deployment's CA and certificates, made with `kiln credentials init --pki-dir
# DIR` when DIR has none (keep DIR: it holds the CA key; `kiln credentials issue --pki-dir DIR
# --team T` gives teams their certificates). Re-running prints new passwords: apply it once, or
# pass --keep-passwords FILE to reuse the ones recorded there (it is written on first use).
set -euo pipefail

PKI="" DATABASE_URL="" TRIAL=0 PASSWORDS=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --pki) PKI="$2"; shift 2 ;;
    --database-url) DATABASE_URL="$2"; shift 2 ;;
    --trial) TRIAL=1; shift ;;
    --keep-passwords) PASSWORDS="$2"; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z "$PKI" ]]; then
  echo "--pki DIR is required (see --help)" >&2; exit 2
fi
if [[ $TRIAL -eq 0 && -z "$DATABASE_URL" ]]; then
  echo "give --database-url URL (postgresql+psycopg://USER:PASSWORD@HOST:5432/kiln) or --trial" >&2
  exit 2
fi

SERVICES=(ledger engine-pool agent-runner cost-model)
NATS_USERS=(ledger engine-pool agent-runner cost-model cli operator)

if [[ ! -f "$PKI/ca.pem" ]]; then
  kiln credentials init --pki-dir "$PKI" >&2
fi

secret() { python3 -c 'import secrets; print(secrets.token_hex(32))'; }

declare -A PW
if [[ -n "$PASSWORDS" && -f "$PASSWORDS" ]]; then
  while IFS='=' read -r k v; do [[ -n "$k" ]] && PW[$k]="$v"; done < "$PASSWORDS"
fi
for u in "${NATS_USERS[@]}" postgres; do
  [[ -n "${PW[$u]:-}" ]] || PW[$u]=$(secret)
done
if [[ -n "$PASSWORDS" && ! -f "$PASSWORDS" ]]; then
  (umask 077; for k in "${!PW[@]}"; do echo "$k=${PW[$k]}"; done > "$PASSWORDS")
fi

for s in "${SERVICES[@]}"; do
  dir="$PKI/services/$s"
  echo "---"
  kubectl create secret generic "kiln-tls-$s" --dry-run=client -o yaml \
    --from-file=ca.pem="$dir/ca.pem" --from-file=cert.pem="$dir/cert.pem" \
    --from-file=key.pem="$dir/key.pem"
done

nats_args=()
for u in "${NATS_USERS[@]}"; do nats_args+=("--from-literal=$u=${PW[$u]}"); done
echo "---"
kubectl create secret generic kiln-nats --dry-run=client -o yaml "${nats_args[@]}"

db_args=()
if [[ $TRIAL -eq 1 ]]; then
  # hex: the password goes into a URL as it is.
  DATABASE_URL=${DATABASE_URL:-"postgresql+psycopg://kiln:${PW[postgres]}@postgres:5432/kiln"}
  db_args+=("--from-literal=postgres-password=${PW[postgres]}")
fi
echo "---"
kubectl create secret generic kiln-database --dry-run=client -o yaml \
  "--from-literal=url=$DATABASE_URL" "${db_args[@]}"
