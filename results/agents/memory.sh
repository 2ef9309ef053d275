# The resident memory of each study run of one task, sampled every 5 s while `run.py` runs (a few ms of CPU each):
#   bash results/agents/memory.sh $SCRATCH/rss.log [calculator|guess-number] &
# report.py --memory $SCRATCH/rss.log [--memory-task TASK] turns the log into memory-<task>.json.
task=${2:-calculator}
while true; do
  for pid in $(pgrep -f "vineppo train --config examples/$task/"); do
    run=$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -o "iterations-[a-z]*-s[0-9]\|seconds-[a-z]*-s[0-9]")
    rss=$(awk '/VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null)
    # Only the study's own runs: another `vineppo train` of the task (a probe, an example) has no run name.
    [ -n "$run" ] && [ -n "$rss" ] && echo "$run $rss" >> "$1"
  done
  sleep 5
done
