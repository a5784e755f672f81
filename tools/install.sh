#!/bin/sh
# Installs a requirements file into the virtual environment of PY: with uv
# (the version requirements-dev.txt locks), which installs the lock in
# seconds where pip takes a minute or two; with pip where uv cannot, and for
# an upgrade (make test-latest).  uv is handed the indexes pip is configured
# with (pip's configuration files and PIP_* variables), so both install
# from the same places.  Neither byte-compiles: the modules a run imports
# are compiled when first imported.
#
#   tools/install.sh PY REQUIREMENTS [--upgrade]
set -u
py=$1 reqs=$2 upgrade=${3:-}

pip_setting() { # name in pip's configuration, PIP_* variable
    "$py" -m pip config get "global.$1" 2>/dev/null
    eval "printf '%s\n' \"\${$2:-}\""
}

if [ -z "$upgrade" ]; then
    uv=$(grep '^uv==' requirements-dev.txt)
    if "$py" -m pip install --quiet --no-compile "$uv"; then
        set --
        for url in $(pip_setting index-url PIP_INDEX_URL); do set -- "$@" --index-url "$url"; done
        for url in $(pip_setting extra-index-url PIP_EXTRA_INDEX_URL); do
            set -- "$@" --extra-index-url "$url"
        done
        for dir in $(pip_setting find-links PIP_FIND_LINKS); do set -- "$@" --find-links "$dir"; done
        # The lock pins every version: any index may serve it.
        if "$py" -m uv pip install --quiet --python "$py" --index-strategy unsafe-best-match \
                "$@" -r "$reqs"; then
            exit 0
        fi
    fi
    echo "install: uv could not install $reqs; pip installs it" >&2
fi
exec "$py" -m pip install --quiet --no-compile $upgrade -r "$reqs"
