#!/usr/bin/env bash
# The gpu tier on a CUDA machine with nothing prepared: install what is missing (never torch: the
# machine's CUDA build stays), run `pytest -m gpu` under a hard time limit, then bench/bench_gpu.py,
# and write a short report.
#
#   bash scripts/gpu_check.sh [REPORT_DIR]      # default: $OUT when set, else ./gpu-report
#   bash scripts/gpu_check.sh --download [DIR]  # here, with a package index: fetch the wheels a machine
#                                               # without network needs into DIR (default .whl/)
#
# Packages come from the index, or only from LSYNC_WHEELS (default .whl/ when it exists) on a machine
# that reaches none. Environment: PYTHON (default python3), LSYNC_GPU_LIMIT (seconds for the tier,
# default 420), LSYNC_GPU_VENV (default .venv-gpu), LSYNC_GPU_DRY_RUN=1 (go on without CUDA, every test
# skipped: to try the script itself on a CPU machine). Exit: pytest's; 2 when there is no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The tier's needs beyond torch: setup.cfg's install_requires and the test extras the tier imports.
NEEDS=(lightning lightning-utilities torchmetrics hydra-core omegaconf antlr4-python3-runtime torchdata
       pytest pytest-timeout pyarrow numpy packaging pyyaml)

pin() {  # NAME -> NAME==VERSION from constraints.txt (the demo pins), else hydra-core's antlr4 pin, else NAME
  local v
  v=$(grep -iE "^$1==" constraints.txt | head -n 1 || true)
  [ -z "$v" ] && [ "$1" = antlr4-python3-runtime ] && v="antlr4-python3-runtime==4.9.3"  # hydra-core: ==4.9.*
  echo "${v:-$1}"
}

if [ "${1:-}" = "--download" ]; then
  dir=${2:-.whl}
  mkdir -p "$dir"
  py=${LSYNC_GPU_PY:-3.12}
  for name in lightning lightning-utilities torchmetrics hydra-core omegaconf antlr4-python3-runtime torchdata \
              pytest-timeout; do
    spec=$(pin "$name")
    # a binary for the GPU machine's Python, else a wheel built here from the sdist (pure Python ones)
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$dir" "$spec" 2>/dev/null \
      || "$PY" -m pip wheel -q --no-deps -w "$dir" "$spec"
  done
  ls -l "$dir"
  exit 0
fi

REPORT=${1:-${OUT:-gpu-report}}
mkdir -p "$REPORT"
REPORT=$(cd "$REPORT" && pwd)
if ! "$PY" - <<'EOF'
import sys
try:
    import torch
except ImportError:
    sys.exit("gpu_check: no CUDA device: torch is not installed for this python (" + sys.executable + ")")
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda}, "
             f"torch.cuda.is_available() is False); run it on a GPU machine with a CUDA build of torch")
print(f"gpu_check: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}")
EOF
then
  [ "${LSYNC_GPU_DRY_RUN:-0}" = 1 ] || exit 2
  echo "gpu_check: LSYNC_GPU_DRY_RUN=1: going on without CUDA (every test of the tier is skipped)"
fi

# A venv that sees the machine's packages (its CUDA torch among them) through a .pth file, so pip
# counts them as installed and adds only what is missing; `--system-site-packages` alone would see
# the base interpreter's packages, not those of a virtualenv python3 belongs to.
VENV=${LSYNC_GPU_VENV:-.venv-gpu}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages --without-pip "$VENV"
  "$PY" -c 'import site, sysconfig; print("\n".join(dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"]])))' \
    > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_lsync_host_site.pth"
fi
VPY=$VENV/bin/python
torch_version=$("$VPY" -c 'import torch; print(torch.__version__)')
constraints=$VENV/constraints-gpu.txt
{ echo "torch==$torch_version"; grep -viE '^(torch|#)' constraints.txt | grep -v '^$'; } > "$constraints"
WHEELS=${LSYNC_WHEELS:-}
[ -z "$WHEELS" ] && [ -d .whl ] && WHEELS=.whl
index=()
[ -n "$WHEELS" ] && index=(--no-index --find-links "$WHEELS")
missing=$("$VPY" - "${NEEDS[@]}" <<'EOF'
import sys
from importlib import metadata

def installed(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False

print(" ".join(n for n in sys.argv[1:] if not installed(n)))
EOF
)
if [ -n "$missing" ]; then
  echo "gpu_check: installing $missing ${WHEELS:+(from $WHEELS only)}"
  # the machine's versions of everything else are kept: only missing names are pinned to constraints.txt
  specs=()
  for name in $missing; do specs+=("$(pin "$name")"); done
  "$VPY" -m pip install -q --disable-pip-version-check "${index[@]}" -c <(echo "torch==$torch_version") "${specs[@]}"
fi
"$VPY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
  || echo "gpu_check: lightning_sync not installed (tests import it from the working tree)"
"$VPY" -m pip list --disable-pip-version-check --format=freeze 2>/dev/null \
  | grep -iE '^(torch|lightning|pytorch-lightning|torchmetrics|hydra-core|omegaconf|torchdata|pytest)==' > "$REPORT/versions.txt" || true

export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
limit=${LSYNC_GPU_LIMIT:-420}
start=$(date +%s)
set +e
timeout -k 10 "$limit" "$VPY" -m pytest -m gpu -v -rs -p no:cacheprovider --durations=0 \
  --junitxml="$REPORT/junit.xml" 2>&1 | tee "$REPORT/pytest.log"
rc=${PIPESTATUS[0]}
tier=$(( $(date +%s) - start ))
timeout -k 5 90 "$VPY" bench/bench_gpu.py --json "$REPORT/bench_gpu.json" 2>&1 | tee "$REPORT/bench_gpu.txt"
bench_rc=${PIPESTATUS[0]}
set -e

"$VPY" - "$REPORT" "$rc" "$tier" "$limit" "$bench_rc" <<'EOF' | tee "$REPORT/report.md"
import pathlib, sys, xml.etree.ElementTree as ET
report, rc, tier, limit, bench_rc = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
print(f"# gpu_check report\n\npytest -m gpu: exit {rc} in {tier} s (limit {limit} s"
      + ("; killed at the limit)" if rc in (124, 137) else ")"))
print("\nversions:", ", ".join(pathlib.Path(report, "versions.txt").read_text().split()))
junit = report / "junit.xml"
if junit.exists():
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    print(f"\ntests {suite.get('tests')}, failures {suite.get('failures')}, errors {suite.get('errors')}, "
          f"skipped {suite.get('skipped')}, {float(suite.get('time', 0)):.1f} s\n")
    for case in suite.iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        print(f"- {case.get('name')}: {outcome} ({float(case.get('time', 0)):.1f} s)")
        for c in case:
            if c.tag in ("failure", "error"):
                print("  " + (c.get("message") or "")[:400].replace("\n", " "))
else:
    print("\nno junit.xml: pytest did not finish (see pytest.log)")
bench = report / "bench_gpu.txt"
print(f"\nbench/bench_gpu.py (exit {bench_rc}):\n")
print("\n".join("    " + line for line in bench.read_text().splitlines()[-12:]) if bench.exists() else "    (none)")
EOF
exit "$rc"
