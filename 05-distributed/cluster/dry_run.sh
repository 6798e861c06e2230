#!/bin/bash
# Run a Slurm batch script here, without Slurm, to see what it would start.
#
#   usage: bash dry_run.sh BATCH_SCRIPT [NODES] [GPUS_PER_NODE] [CPUS_PER_TASK] [JOB_ID]
#
# Stand-ins for `scontrol` and `srun` go first on PATH: `scontrol show hostnames` names
# NODES fake nodes (node001, ...), and `srun` prints its command line, shell-quoted, on a
# line that starts with DRYRUN instead of running it, then the variables it would pass on
# that decide a rank's resources, on a line that starts with DRYENV. The SLURM_* variables a
# batch job sees are set to match (CPUS_PER_TASK default 32, JOB_ID default 12345). Nothing
# is submitted and no training runs.
set -euo pipefail
usage="usage: bash dry_run.sh BATCH_SCRIPT [NODES] [GPUS_PER_NODE] [CPUS_PER_TASK] [JOB_ID]"
template=${1:?$usage}
nodes=${2:-2}
gpus=${3:-8}
cpus=${4:-32}
job_id=${5:-12345}

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
printf 'DRYENV'
for name in OMP_NUM_THREADS SRUN_CPUS_PER_TASK; do
    if [[ -n "${!name+set}" ]]; then printf ' %q' "$name=${!name}"; fi
done
printf '\n'
STUB
chmod +x "$stubs/scontrol" "$stubs/srun"

env PATH="$stubs:$PATH" DRY_RUN_NODES="$nodes" \
    SLURM_JOB_ID="$job_id" SLURM_JOB_NAME=dry-run SLURM_NNODES="$nodes" \
    SLURM_JOB_NUM_NODES="$nodes" SLURM_JOB_NODELIST="node[001-$(printf '%03d' "$nodes")]" \
    SLURM_CPUS_PER_TASK="$cpus" SLURM_GPUS_ON_NODE="$gpus" SLURM_SUBMIT_DIR="$PWD" \
    bash "$template"
