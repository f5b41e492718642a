#!/usr/bin/env bash
# Creates .venv (once) with the CPU torch build and lightning_sync installed editable with its test
# and recipe extras. Re-runs are no-ops unless setup.cfg or constraints.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${LSYNC_VENV:-.venv}
# LSYNC_LIGHTNING=2.5.3: the same pins with another Lightning (CI's fast tier on the oldest supported one).
LIGHTNING=${LSYNC_LIGHTNING:-}
CONSTRAINTS=constraints.txt
if [ -n "$LIGHTNING" ]; then
  CONSTRAINTS=$(mktemp)
  trap 'rm -f "$CONSTRAINTS"' EXIT
  sed -E "s/^(lightning|pytorch-lightning)==.*/\1==$LIGHTNING/" constraints.txt >"$CONSTRAINTS"
fi
stamp="$VENV/.lsync-stamp"
want=$(cat setup.cfg "$CONSTRAINTS" pyproject.toml | sha256sum | cut -c1-16)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "bootstrap: creating $VENV (torch CPU build, lightning, torchmetrics, hydra) ..." >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# What `pip install -e ".[test,recipes]"` installs, in two steps so that two bootstraps (CI makes .venv and
# .venv-oldest at once: each is one pip process on one core) never write the checkout together: first the
# requirements setup.cfg lists (pip writes nothing in the checkout), then lightning_sync itself, editable,
# under a lock (setuptools writes lightning_sync.egg-info here).
REQS=()
while IFS= read -r req; do
  REQS+=("$req")
done < <("$VENV/bin/python" - <<'PYEOF'
import configparser

cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
for value in (cfg["options"]["install_requires"], cfg["options.extras_require"]["test"],
              cfg["options.extras_require"]["recipes"]):
    for line in value.splitlines():
        if line.strip() and not line.strip().startswith("#"):
            print(line.strip())
PYEOF
)
[ "${#REQS[@]}" -gt 0 ] || { echo "bootstrap: no requirements read from setup.cfg" >&2; exit 1; }
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" "${REQS[@]}"
mkdir -p build
LOCK=()
if command -v flock >/dev/null 2>&1; then  # (util-linux; where it is missing, one bootstrap at a time is safe)
  LOCK=(flock build/.bootstrap.lock)
fi
${LOCK[@]+"${LOCK[@]}"} "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" \
  --no-deps -e .
# scikit-learn as a reference some tests compare with, outside the venv's site-packages (tests put it on
# PYTHONPATH where they need it): where scipy is importable, torchmetrics imports scipy.signal in every
# process that imports Lightning (about 1 s of CPU a process; users' default install has no scipy)
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" --no-deps --upgrade \
  --target "$VENV/reference" scikit-learn scipy joblib threadpoolctl narwhals
echo "$want" > "$stamp"
