# Sourced by the scripts: installs the Debian packages a command needs, only those missing,
# with one `apt-get update` at most.
mixprec_ensure_packages() {
  local missing=() package
  for package in "$@"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "mixprec: installing ${missing[*]}"
  $sudo apt-get update
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y "${missing[@]}"
}

# Everything the build, the tests, the examples and the demo use.
MIXPREC_PACKAGES=(cmake ninja-build g++ ccache libtorch-dev doctest-dev python3-torch zlib1g-dev
                  dataset-fashion-mnist)
