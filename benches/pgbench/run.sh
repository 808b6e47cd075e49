#!/bin/bash
# The claim statements of `PgStore` against the hand-written claim-first,
# without a Rust client: pgbench (C, prepared statements) runs each script
# for SECS seconds with CONC connections, the scripts interleaved and
# repeated REPS times; per run it prints the transactions per second and
# the CPU time of every PostgreSQL process per transaction (live processes'
# utime + stime, plus what the postmaster reaped from ended backends).
#
#   benches/pgbench/run.sh fresh 5 15 8 fresh-c fresh-store fresh-store-locking
#   benches/pgbench/run.sh dup   3 10 8 dup-c dup-store dup-store-locking
#   benches/pgbench/run.sh dup   3 10 8 dup-batch8-store dup-batch8-store-locking   # 8 per transaction
#
# `fresh` empties the tables before each run (every key is new); `dup` fills
# the marker table with 200 000 live markers once and each transaction
# claims one of them, then rolls back. Needs PostgreSQL on 127.0.0.1:5432
# (database `test`, trust auth) and pgbench; makes tables pgb_m and pgb_p.
# PGBENCH_MODE=simple sends every statement as a simple query (default:
# prepared). PGBENCH_PERF=1 also samples every CPU with `perf record -a`
# (999 Hz, needs root) during each run and prints the CPU time per
# transaction spent in the `postgres` binary itself (the executor, planner
# and catalog code, without the kernel, TLS and libc that carry most of a
# run's noise) and in `AtEOXact_GUC` (the settings' reset at transaction end).
set -euo pipefail
mode=$1; reps=$2; secs=$3; conc=$4; shift 4
here=$(dirname "$0")
pg() { psql -X -q -h 127.0.0.1 -U postgres -d test "$@"; }
server_ticks() {
    local total=0 p v
    for p in $(pgrep -x postgres); do
        v=$(awk '{print $14 + $15 + $16 + $17}' "/proc/$p/stat" 2>/dev/null || echo 0)
        total=$((total + ${v:-0}))
    done
    echo "$total"
}
pg -f "$here/setup.sql"
# The marker table is PgStore's, from the same migration file.
sed 's/processed_messages/pgb_m/g' "$here/../../idempotent-runtime/sql/postgres.sql" | pg
if [ "$mode" = dup ]; then
    pg -c "INSERT INTO pgb_m (scope, message_id, expires_at) \
           SELECT 'handle', 'm' || g, now() + interval '7 days' FROM generate_series(1, 200000) g"
    pg -c "VACUUM ANALYZE pgb_m"
fi
hz=$(getconf CLK_TCK)
for r in $(seq 1 "$reps"); do
    for v in "$@"; do
        [ "$mode" = fresh ] && pg -c "TRUNCATE pgb_m, pgb_p"
        if [ -n "${PGBENCH_PERF:-}" ]; then
            data=$(mktemp)
            perf record -q -a -F 999 -o "$data" -- sleep $((secs + 1)) > /dev/null 2>&1 &
            perf_pid=$!
            sleep 0.5
        fi
        before=$(server_ticks)
        out=$(pgbench -h 127.0.0.1 -U postgres -n -M "${PGBENCH_MODE:-prepared}" -c "$conc" -j 2 -T "$secs" -f "$here/$v.sql" test 2>&1)
        after=$(server_ticks)
        tx=$(echo "$out" | awk '/number of transactions actually processed/ {print $NF}' | cut -d/ -f1)
        tps=$(echo "$out" | awk '/^tps/ {printf "%.0f", $3}')
        line="rep $r  $v  c=$conc  tps $tps  server µs/tx $(( (after - before) * 1000000 / hz / tx ))"
        if [ -n "${PGBENCH_PERF:-}" ]; then
            wait "$perf_pid"
            # One sample per 1/999 s of one CPU.
            binary=$(perf report -i "$data" --comm postgres --sort dso --stdio -F sample,dso 2> /dev/null |
                awk '$2 == "postgres" {print $1}')
            guc=$(perf report -i "$data" --comm postgres --sort sym --stdio -F sample,sym 2> /dev/null |
                awk '/AtEOXact_GUC/ {print $1}')
            line="$line  postgres binary µs/tx $(echo "scale=1; ${binary:-0} * 1000000 / 999 / $tx" | bc)"
            line="$line  AtEOXact_GUC µs/tx $(echo "scale=2; ${guc:-0} * 1000000 / 999 / $tx" | bc)"
            rm -f "$data"
        fi
        echo "$line"
    done
done
pg -c "DROP TABLE pgb_m, pgb_p"
