#!/usr/bin/env bash
# Start a throwaway PostgreSQL server (Debian's package) on a unix socket and print its URL, for the
# shared-study tests (LAB_TEST_PG_URL) or a local try of `python -m lab sweep --storage postgresql://...`.
#   export LAB_TEST_PG_URL=$(bash scripts/pg_start.sh)      # stop: pg_ctl -D <dir>/data stop
set -euo pipefail
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null
fi
bin=$(dirname "$(ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -1)")
dir=$(mktemp -d /tmp/labpg.XXXXXX)
as=()
if [ "$(id -u)" = 0 ]; then chown postgres "$dir"; as=(runuser -u postgres --); fi  # the server refuses root
"${as[@]}" "$bin/initdb" -D "$dir/data" -A trust -U postgres >/dev/null
"${as[@]}" "$bin/pg_ctl" -D "$dir/data" -o "-k $dir -c listen_addresses=''" -l "$dir/log" -w start >/dev/null
echo "postgresql://postgres@/postgres?host=$dir"
