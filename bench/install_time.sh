#!/usr/bin/env bash
# The README's install figures: each requirements file installed in a clean clone and a new venv, pip's cache off
# (as on a fresh machine), with one shared build environment (the README's commands) and with one per distribution.
# Run: bash bench/install_time.sh (writes /tmp/instm/times.txt; about 12 minutes).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p /tmp/instm && cd /tmp/instm && rm -f times.txt
for req in requirements.txt requirements-dev.txt; do
  for mode in shared isolated; do
    rm -rf clone venv; git clone -q "$ROOT" clone; python -m venv venv
    . venv/bin/activate
    start=$(date +%s)
    if [ $mode = shared ]; then
      pip install -q --no-cache-dir 'setuptools>=69' wheel && (cd clone && pip install -q --no-cache-dir --no-build-isolation -r $req)
    else
      (cd clone && pip install -q --no-cache-dir -r $req)
    fi
    rc=$?
    end=$(date +%s)
    deactivate
    echo "$req $mode rc=$rc $((end-start)) s" >> /tmp/instm/times.txt
  done
done
echo done >> /tmp/instm/times.txt
