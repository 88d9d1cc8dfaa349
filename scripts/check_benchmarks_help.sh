#!/usr/bin/env bash
# Every benchmark answers --help on a CPU machine, both as `python -m benchmarks <name>` and
# as `python -m benchmarks.<name>`. Run from the repository root: scripts/check_benchmarks_help.sh
set -u
PYTHON=${PYTHON:-python}
failed=0
for name in $($PYTHON -c 'from benchmarks.__main__ import runnable; print(*runnable())'); do
    for form in "-m benchmarks $name" "-m benchmarks.$name"; do
        if CUDA_VISIBLE_DEVICES= $PYTHON $form --help >/dev/null 2>/tmp/bench_help_err.$$; then
            echo "ok    python $form --help"
        else
            echo "FAIL  python $form --help"; sed 's/^/      /' /tmp/bench_help_err.$$ | tail -5
            failed=1
        fi
    done
done
rm -f /tmp/bench_help_err.$$
exit $failed
