# Sourced by setup_te.sh and setup_bridge.sh: their failure message, and a venv layered over another.
# Needs SETUP (the make target's name, for messages) and MAIN_VENV (whose python creates venvs).

fail() {
  echo "$SETUP FAILED: $*" >&2
  exit 1
}

# layer_venv VENV BASE NAME: create VENV (without pip: .venv's pip installs into it) unless it exists, and
# add BASE's site-packages to it with site.addsitedir, so BASE's own .pth files (this package's
# editable install, BASE's own layer) apply too, through VENV's NAME.pth. Sets VENV_SITE and BASE_SITE.
layer_venv() {
  local venv=$1 base=$2 name=$3
  [ -x "$venv/bin/python" ] || "$MAIN_VENV/bin/python" -m venv --without-pip "$venv" || fail "could not create $venv"
  BASE_SITE=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  VENV_SITE=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  echo "import site; site.addsitedir('$BASE_SITE')" >"$VENV_SITE/$name.pth"
}
