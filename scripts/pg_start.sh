#!/usr/bin/env bash
# Start a throwaway PostgreSQL server (Debian's package) on a unix socket and print its URL, for the
# shared-study tests (LAB_TEST_PG_URL) or a local try of `python -m lab sweep --storage postgresql://...`.
#   export LAB_TEST_PG_URL=$(bash scripts/pg_start.sh)      # stop: pg_ctl -D <dir>/data stop
# LAB_PG_ROOT: a folder holding a copied server instead of an installed one (the GPU machine, which has
# no package registry): usr/lib/postgresql/<v>/{bin,lib}, usr/share/postgresql/<v>, the shared libraries
# the server needs beyond the C runtime in lib/, and zoneinfo/ (used when /usr/share/zoneinfo is absent).
set -euo pipefail
if [ -n "${LAB_PG_ROOT:-}" ]; then
  prefix="$LAB_PG_ROOT"
  export LD_LIBRARY_PATH="$LAB_PG_ROOT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  [ -d /usr/share/zoneinfo ] || cp -a "$LAB_PG_ROOT/zoneinfo" /usr/share/zoneinfo
  id postgres >/dev/null 2>&1 || timeout 30 useradd -r -M postgres
else
  prefix=""
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null
  fi
fi
bin=$(dirname "$(ls "$prefix"/usr/lib/postgresql/*/bin/initdb | sort -V | tail -1)")
dir=$(mktemp -d /tmp/labpg.XXXXXX)
as=(env "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" TZ=UTC)
if [ "$(id -u)" = 0 ]; then chown postgres "$dir"; as=(runuser -u postgres -- "${as[@]}"); fi  # the server refuses root
# Bounded steps: a stuck step fails with the server's log on stderr instead of holding the caller.
fail() { echo "pg_start.sh: $1 failed or timed out; server log:" >&2; cat "$dir/log" >&2 2>/dev/null; exit 1; }
timeout 120 "${as[@]}" "$bin/initdb" -D "$dir/data" -A trust -U postgres >/dev/null </dev/null || fail initdb
timeout 90 "${as[@]}" "$bin/pg_ctl" -D "$dir/data" -o "-k $dir -c listen_addresses=''" -l "$dir/log" -t 60 -w start \
  >/dev/null </dev/null || fail "pg_ctl start"
echo "postgresql://postgres@/postgres?host=$dir"
