"""NATS users, their subject permissions, and the server configuration that holds them.

One user per service and one for the CLI (:data:`NATS_USERS`); each may publish and subscribe
only the subjects its work needs (:func:`permissions`), JetStream API subjects included, so
stream management is the owners' (:data:`kiln.common.nats.STREAM_OWNERS`) and nobody deletes a
stream. No anonymous connections: a server with ``authorization { users = [...] }`` refuses a
client without a listed user. Who needs what, and why: docs/design/security.md, "NATS".

``kiln up`` generates the passwords once (:class:`NatsPasswords`) and writes the embedded
server's configuration (:func:`render_config`); docker-compose mounts the same configuration
with the passwords taken from its environment (``deploy/nats/nats-server.conf``, written by
:func:`compose_config`).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from kiln.common import nats as kn
from kiln.common.settings import NATS_CREDENTIALS_DIR
from kiln.embedded.private import write_private

NATS_USERS: Final = ("ledger", "engine-pool", "agent-runner", "cost-model", "cli", "operator")
"""The users: the four services (``kiln serve NAME``), ``cli``, what the CLI does on NATS
(``kiln ledger subscribe``, ``kiln status``), and ``operator``, the deployment's owner
(inspection and repair: every subject, like the CA key its password stays in the state
directory; no service is given it)."""

_JS: Final = "$JS.API"


@dataclass(frozen=True)
class Permissions:
    """Subjects a user may publish to and subscribe to (NATS wildcards); nothing else."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    deny_publish: tuple[str, ...] = ()
    """Subjects refused even where ``publish`` allows them (the operator's)."""


def _reader(stream: str, *, delete: bool = False) -> list[str]:
    """JetStream API a client needs to read ``stream`` through ordered consumers (ephemeral,
    unnamed: nats-py creates them on ``CONSUMER.CREATE.<stream>``): stream info, create and
    inspect its consumers, flow-control replies (sent under load), and with ``delete`` delete
    them (:class:`kiln.ledger.events_feed.EventsFeed` does on exit)."""
    return [
        f"{_JS}.STREAM.INFO.{stream}",
        f"{_JS}.CONSUMER.CREATE.{stream}",
        f"{_JS}.CONSUMER.INFO.{stream}.*",
        *([f"{_JS}.CONSUMER.DELETE.{stream}.*"] if delete else []),
        f"$JS.FC.{stream}.>",
    ]


def _owner(stream: str) -> list[str]:
    """Create and update ``stream`` (never delete)."""
    return [f"{_JS}.STREAM.CREATE.{stream}", f"{_JS}.STREAM.UPDATE.{stream}"]


def permissions(prefix: str) -> dict[str, Permissions]:
    """Every user's permissions for the subjects and streams of ``prefix``.

    Each user also may subscribe to its own reply inbox (``_INBOX.<user>.>``, see
    :func:`kiln.common.nats.inbox_prefix`) and ask JetStream for its account's info (health
    checks). Raises InvalidArgument on a bad prefix.
    """
    events = kn.events_stream_name(prefix)
    board = kn.board_stream_name(prefix)
    work = kn.work_stream_name(prefix)
    traffic = kn.traffic_stream_name(prefix)
    bucket = kn.registry_bucket(prefix)
    registry = f"KV_{bucket}"
    table: dict[str, tuple[list[str], list[str]]] = {
        # The outbox publisher: publishes committed events, reads the stream's last message.
        "ledger": (
            [
                f"{prefix}.events.>",
                *_owner(events),
                f"{_JS}.STREAM.INFO.{events}",
                f"{_JS}.STREAM.MSG.GET.{events}",
            ],
            [],
        ),
        # Publishes work items; posts, claims and reads the board; publishes the traffic its
        # ObserveTraffic receives and reads it back for its deployments' controllers.
        "agent-runner": (
            [
                f"{prefix}.work.experiments.>",
                f"{prefix}.board.>",
                *_owner(work),
                f"{_JS}.STREAM.INFO.{work}",
                *_owner(board),
                *_reader(board),
                f"{_JS}.STREAM.MSG.GET.{board}",
                f"{prefix}.traffic.>",
                *_owner(traffic),
                *_reader(traffic),
                f"{_JS}.STREAM.MSG.GET.{traffic}",
            ],
            [],
        ),
        # Takes work items through its durable pull consumers and acks them; counts new items
        # (core subscription); keeps its registry bucket.
        "engine-pool": (
            [
                f"{_JS}.STREAM.INFO.{work}",
                f"{_JS}.CONSUMER.DURABLE.CREATE.{work}.*",
                f"{_JS}.CONSUMER.MSG.NEXT.{work}.*",
                f"$JS.ACK.{work}.>",
                f"$KV.{bucket}.>",
                f"{_JS}.STREAM.CREATE.{registry}",  # an existing bucket is used as it is
                *_reader(registry),
                f"{_JS}.STREAM.MSG.GET.{registry}",
                # Answers the cost model's microbenchmark requests in its reply inbox.
                f"{kn.inbox_prefix('cost-model')}.>",
            ],
            [f"{prefix}.work.experiments.>", f"{prefix}.microbench.>"],
        ),
        # Asks the engine pools for microbenchmarks (requests; replies in its inbox).
        "cost-model": ([f"{prefix}.microbench.>"], []),
        # `kiln ledger subscribe`: reads the events stream.
        "cli": (_reader(events, delete=True), []),
        # The deployment's owner: everything but deleting or purging (inspecting consumers,
        # repairing streams).
        "operator": ([">"], [">"]),
    }
    return {
        user: Permissions(
            publish=(f"{_JS}.INFO", *pub),
            subscribe=(f"{kn.inbox_prefix(user)}.>", *sub),
            deny_publish=NO_DELETE if user == "operator" else (),
        )
        for user, (pub, sub) in table.items()
    }


def traffic_publisher(prefix: str, deployment_id: str) -> Permissions:
    """What a serving system needs to feed one deployment's observed traffic straight into NATS
    (a user an operator adds beside :data:`NATS_USERS`): publish on
    ``{prefix}.traffic.{deployment_id}`` (a core publish lands in the traffic stream; a
    JetStream publish also wants its reply inbox). docs/design/deployments.md, "Traffic feed".
    """
    return Permissions(
        publish=(kn.traffic_subject(prefix, deployment_id),),
        subscribe=("_INBOX.>",),
    )


NO_DELETE: Final = (
    f"{_JS}.STREAM.DELETE.>",
    f"{_JS}.STREAM.PURGE.>",
    f"{_JS}.STREAM.MSG.DELETE.>",
)
"""What not even the operator may publish: a stream's record is never deleted or purged."""


# --- the server configuration -------------------------------------------------------------
def _quote(value: str) -> str:
    return json.dumps(value)  # a NATS config string is a JSON string


def _password(value: str) -> str:
    """A literal password, quoted; ``$NAME`` stays a reference to the server's environment."""
    if value.startswith("$"):
        return value
    return _quote(value)


def render_authorization(prefix: str, passwords: Mapping[str, str]) -> str:
    """The ``authorization`` block: one entry per user of :data:`NATS_USERS` with its password
    (``$VAR`` = the server's environment variable VAR) and permissions.

    Raises:
        KeyError: a user has no password.
    """
    perms = permissions(prefix)

    def subjects(items: tuple[str, ...], deny: tuple[str, ...] = ()) -> str:
        inner = "".join(f"            {_quote(item)}\n" for item in items)
        denied = "".join(f"            {_quote(item)}\n" for item in deny)
        refused = "          deny: [\n" + denied + "          ]\n" if deny else ""
        return "{\n          allow: [\n" + inner + "          ]\n" + refused + "        }"

    entries = [
        "    {\n"
        f"      user: {_quote(user)}\n"
        f"      password: {_password(passwords[user])}\n"
        "      permissions: {\n"
        f"        publish: {subjects(perms[user].publish, perms[user].deny_publish)}\n"
        f"        subscribe: {subjects(perms[user].subscribe)}\n"
        "      }\n"
        "    }"
        for user in NATS_USERS
    ]
    return "authorization {\n  users: [\n" + "\n".join(entries) + "\n  ]\n}\n"


def render_config(
    prefix: str,
    passwords: Mapping[str, str],
    *,
    host: str,
    port: int,
    store_dir: Path,
    pid_file: Path,
    log_file: Path,
) -> str:
    """A whole server configuration: listen address, JetStream store, pid and log files, and
    :func:`render_authorization`'s users."""
    return (
        "# Written by `kiln up` (kiln.embedded.nats_auth); rewritten on every `kiln up`.\n"
        f"listen: {_quote(f'{host}:{port}')}\n"
        f"pid_file: {_quote(str(pid_file))}\n"
        f"log_file: {_quote(str(log_file))}\n"
        f"jetstream {{\n  store_dir: {_quote(str(store_dir))}\n}}\n"
        + render_authorization(prefix, passwords)
    )


def password_variable(user: str) -> str:
    """The environment variable holding ``user``'s password under docker-compose, e.g.
    ``KILN_NATS_ENGINE_POOL_PASSWORD``."""
    return f"KILN_NATS_{user.replace('-', '_').upper()}_PASSWORD"


def compose_config(prefix: str = "kiln") -> str:
    """The configuration docker-compose mounts into its NATS container: the users of
    :func:`render_authorization`, passwords from :func:`password_variable`'s variables
    (JetStream, store and monitoring come from the container's command line)."""
    refs = {user: f"${password_variable(user)}" for user in NATS_USERS}
    return (
        "# kiln's NATS users for docker-compose. Generated by kiln.embedded.nats_auth."
        "compose_config();\n"
        "# tests/unit/test_nats_auth.py fails when it differs. Passwords come from the "
        'container\'s\n# environment (docker-compose.yml; README, "Docker Compose").\n'
        + render_authorization(prefix, refs)
    )


# --- the passwords ------------------------------------------------------------------------
class NatsPasswords:
    """The embedded NATS's passwords: one file per user in ``directory`` (directory 0700, files
    0600), generated once and kept across ``kiln up``s; ``kiln up`` uses
    ``state_dir/nats/credentials/`` (:meth:`of_state_dir`), where the CLI finds its own."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    @classmethod
    def of_state_dir(cls, state_dir: Path) -> NatsPasswords:
        """The passwords of ``kiln up``'s embedded NATS under ``state_dir``."""
        return cls(Path(state_dir) / NATS_CREDENTIALS_DIR)

    def path(self, user: str) -> Path:
        """The file holding ``user``'s password."""
        return self.directory / user

    def ensure(self) -> dict[str, str]:
        """Every user's password, generating the missing ones (32 random bytes, hex)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        found = {}
        for user in NATS_USERS:
            path = self.path(user)
            try:
                found[user] = path.read_text().strip()
            except FileNotFoundError:
                found[user] = ""
            if not found[user]:
                found[user] = secrets.token_hex(32)
                write_private(path, found[user] + "\n")
            else:
                os.chmod(path, 0o600)
        return found

    def credentials(self, user: str) -> tuple[str, str] | None:
        """(user, password) when its file exists, else None."""
        try:
            password = self.path(user).read_text().strip()
        except FileNotFoundError:
            return None
        return (user, password) if password else None

    def service_env(self, user: str) -> dict[str, str]:
        """The variables that give a service process ``user``'s credentials (a file path: no
        secret in its environment)."""
        return {"KILN_NATS_USER": user, "KILN_NATS_PASSWORD_FILE": str(self.path(user))}
