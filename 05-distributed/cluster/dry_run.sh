#!/bin/bash
# Run a Slurm batch script here, without Slurm, to see what it would start.
#
#   usage: bash dry_run.sh BATCH_SCRIPT [NODES] [GPUS_PER_NODE]
#
# Stand-ins for `scontrol` and `srun` go first on PATH: `scontrol show hostnames` names
# NODES fake nodes (node001, ...), and `srun` prints its command line, shell-quoted, on a
# line that starts with DRYRUN instead of running it. The SLURM_* variables a batch job
# sees are set to match. Nothing is submitted and no training runs.
set -euo pipefail
template=${1:?usage: bash dry_run.sh BATCH_SCRIPT [NODES] [GPUS_PER_NODE]}
nodes=${2:-2}
gpus=${3:-8}

stubs=$(mktemp -d)
trap 'rm -rf "$stubs"' EXIT
cat > "$stubs/scontrol" <<'STUB'
#!/bin/bash
if [[ "${1:-} ${2:-}" != "show hostnames" ]]; then
    echo "dry run: unexpected scontrol $*" >&2
    exit 1
fi
for i in $(seq 1 "$DRY_RUN_NODES"); do printf 'node%03d\n' "$i"; done
STUB
cat > "$stubs/srun" <<'STUB'
#!/bin/bash
printf 'DRYRUN srun'
printf ' %q' "$@"
printf '\n'
STUB
chmod +x "$stubs/scontrol" "$stubs/srun"

env PATH="$stubs:$PATH" DRY_RUN_NODES="$nodes" \
    SLURM_JOB_ID=12345 SLURM_JOB_NAME=dry-run SLURM_NNODES="$nodes" \
    SLURM_JOB_NUM_NODES="$nodes" SLURM_JOB_NODELIST="node[001-$(printf '%03d' "$nodes")]" \
    SLURM_CPUS_PER_TASK=32 SLURM_GPUS_ON_NODE="$gpus" SLURM_SUBMIT_DIR="$PWD" \
    bash "$template"
