#!/usr/bin/env bash
# Makes .venv and installs jax_megamoe into it, doing only what changed since the last call.
#
#   bash scripts/setup_env.sh [EXTRAS]     EXTRAS: comma list of pyproject extras (default: nn)
#
# Two steps, each skipped when its inputs are unchanged (their hashes are recorded in .venv/.jmm/):
#   dependencies  pip installs the build requirements, cmake, ninja, the project's dependencies and EXTRAS;
#                 inputs: pyproject.toml's requirements, EXTRAS, the Python version.
#   extension     an editable install (`pip install --no-build-isolation --no-deps -e .`): the Python
#                 sources are used in place and the compiled extension lands in .venv; scikit-build-core
#                 keeps its CMake build in build/<wheel tag>/, so a rebuild recompiles only what changed;
#                 inputs: pyproject.toml's build tables, CMakeLists.txt, every file under cuda/, the
#                 names of the files under jax_megamoe/, JMM_CUDA, the nvcc found, and the versions of
#                 jax, jaxlib, nanobind, nvidia-cutlass and scikit-build-core.
# So an unchanged tree costs a few hashes and no pip call. The editable install's import hook takes
# precedence over the current directory, so `import jax_megamoe` works from the repository root too.
#
# Environment: PYTHON (interpreter for the venv; default: the first python3.X >= 3.11 on PATH),
# JMM_CUDA (AUTO, the default: build the CUDA kernels where nvcc is found; ON: require them; OFF: skip),
# JMM_SETUP_SKIP_BUILD=1 (dependencies only: for checks that need no extension),
# CMAKE_BUILD_PARALLEL_LEVEL (compile jobs; default: the number of cores).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
extras=${1:-nn}
venv=$root/.venv
state=$venv/.jmm

find_python() {
  local candidate
  for candidate in ${PYTHON:-} python3 python3.14 python3.13 python3.12 python3.11; do
    if command -v "$candidate" > /dev/null &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2> /dev/null; then
      echo "$candidate"
      return
    fi
  done
  echo "setup_env.sh: needs Python >= 3.11 (set PYTHON=/path/to/python3.11 or newer)" >&2
  return 1
}

hash_files() {  # hash_files PATH...: one hash over the names and contents of the files under PATHs
  find "$@" -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z |
    xargs -0 sha256sum | sha256sum | cut -c1-64
}

if [[ ! -x $venv/bin/python ]]; then
  python=$(find_python)
  echo "setup_env.sh: creating .venv with $python"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
mkdir -p "$state"
py=$venv/bin/python

# One set-up at a time (train.sh and test.sh may start together).
if command -v flock > /dev/null; then
  exec 9> "$state/lock"
  flock 9
fi

pyproject_part() {  # pyproject_part deps|build: the tables of pyproject.toml that the step depends on
  "$py" - "$1" <<'PYEOF'
import json, sys, tomllib
meta = tomllib.load(open("pyproject.toml", "rb"))
project = meta["project"]
if sys.argv[1] == "deps":
    part = [meta["build-system"], project.get("dependencies"), project.get("optional-dependencies")]
else:
    part = [meta["build-system"], project["name"], project["version"], meta.get("tool", {}).get("scikit-build")]
print(json.dumps(part, sort_keys=True))
PYEOF
}

py_version=$("$py" -c 'import sys; print(sys.version)')
deps_key=$(printf '%s\n' "$(pyproject_part deps)" "$extras" "$py_version" | sha256sum | cut -c1-64)
deps_stamp=$state/deps-${extras//,/+}
if [[ $(cat "$deps_stamp" 2> /dev/null) != "$deps_key" ]]; then
  echo "setup_env.sh: installing dependencies (extras: $extras)"
  # The requirements of pyproject.toml: the build system's, cmake and ninja (the build runs without
  # isolation, so that its paths stay the same from build to build), the project's and the extras'.
  "$py" - "$extras" > "$state/requirements.txt" <<'PYEOF'
import sys, tomllib
meta = tomllib.load(open("pyproject.toml", "rb"))
project = meta["project"]
name = project["name"]
wanted, seen, out = [e for e in sys.argv[1].split(",") if e], set(), list(meta["build-system"]["requires"])
out += ["cmake>=3.26", "ninja"] + project.get("dependencies", [])
while wanted:
    extra = wanted.pop()
    if extra in seen:
        continue
    seen.add(extra)
    if extra not in project.get("optional-dependencies", {}):
        sys.exit(f"setup_env.sh: pyproject.toml has no extra {extra!r}")
    for req in project["optional-dependencies"][extra]:
        if req.replace("-", "_").startswith(name + "["):  # a reference to the project's own extras
            wanted += req[req.index("[") + 1:req.index("]")].split(",")
        else:
            out.append(req)
print("\n".join(out))
PYEOF
  "$py" -m pip install --quiet -r "$state/requirements.txt"
  # pip keeps a package that nothing requires any more: `kernels`, which newer transformers require, breaks the
  # import of the older transformers that tunix's safetensors<0.8 admits, in a .venv made before the tunix extra.
  if "$py" - <<'PYEOF'
import importlib.metadata as md, sys
try:
    md.version("kernels")
    needed = any(r.startswith("kernels") and "extra ==" not in r for r in md.requires("transformers") or [])
except md.PackageNotFoundError:  # no kernels, or no transformers
    sys.exit(1)
sys.exit(needed)
PYEOF
  then
    "$py" -m pip uninstall --quiet --yes kernels
  fi
  echo "$deps_key" > "$deps_stamp"
fi

[[ ${JMM_SETUP_SKIP_BUILD:-0} == 1 ]] && exit 0

site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
# The packages whose headers or tools the build uses: a new version of one rebuilds.
build_deps=$("$py" -c 'from importlib.metadata import version as v
print([v(p) for p in ("jax", "jaxlib", "nanobind", "nvidia-cutlass", "scikit-build-core")])')
build_key=$(printf '%s\n' "$(pyproject_part build)" "$(hash_files CMakeLists.txt cuda)" \
  "$(find jax_megamoe -name '*.py' | LC_ALL=C sort)" "JMM_CUDA=${JMM_CUDA:-AUTO}" \
  "nvcc=$(command -v nvcc || true)" "$build_deps" "$py_version" | sha256sum | cut -c1-64)
if [[ $(cat "$state/build" 2> /dev/null) != "$build_key" ]] || ! compgen -G "$site/jax_megamoe/_ext*" > /dev/null; then
  echo "setup_env.sh: building jax_megamoe (JMM_CUDA=${JMM_CUDA:-AUTO}; CUDA kernels where nvcc is found:" \
       "the first build takes minutes, later ones recompile what changed)"
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2> /dev/null || echo 2)}
  "$py" -m pip install --no-build-isolation --no-deps -e .
  echo "$build_key" > "$state/build"
fi
