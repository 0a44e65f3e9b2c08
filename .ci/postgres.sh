#!/usr/bin/env bash
# Start a throw-away PostgreSQL server for the many-workers tests and print its URL.
# Installs Debian's package when it is missing; the server runs as the postgres user
# (initdb refuses root) on a loopback port, with its data in a fresh temporary folder.
set -euo pipefail

PGBIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$PGBIN" ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null && apt-get install -y -qq postgresql >/dev/null
  PGBIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
fi
# A free loopback port unless one is given: a server left by an earlier run must not stop this one.
PORT=${AUTOTUNE_PG_PORT:-$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")}
DATA=$(mktemp -d /tmp/autotune-pg.XXXXXX)
chown postgres "$DATA"
as_postgres() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
as_postgres "$PGBIN/initdb" -D "$DATA" -A trust -U postgres >/dev/null
as_postgres "$PGBIN/pg_ctl" -D "$DATA" -l "$DATA/server.log" -w \
  -o "-p $PORT -k $DATA -c listen_addresses=127.0.0.1 -c max_connections=200" start >/dev/null
as_postgres "$PGBIN/createdb" -h 127.0.0.1 -p "$PORT" -U postgres autotune_test
echo "postgresql://postgres@127.0.0.1:$PORT/autotune_test"
