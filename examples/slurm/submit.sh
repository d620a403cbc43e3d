#!/usr/bin/env bash
# TEXTS=texts.jsonl [TASKS=16] [OUT=corpus-out] [MODEL=...] ./submit.sh
# An array job of TASKS shards, then the merge once every shard has succeeded.
set -euo pipefail
cd "$(dirname "$0")"
TASKS="${TASKS:-16}"
jid=$(sbatch --parsable --array=0-$((TASKS - 1)) --export=ALL corpus.sbatch)
sbatch --dependency=afterok:"$jid" --export=ALL merge.sbatch
