#!/bin/sh
# The one lookup of what the browser test needs, shared by .ci/run, build.rs and tests/browser.rs:
# prints the chromium executable and exits 0 when Node.js, tests/browser/node_modules and
# chromium are all there; otherwise prints what is missing to stderr and exits 1.
# $CHROMIUM overrides where chromium is looked for.
cd "$(dirname "$0")" || exit 1
missing=""
command -v node >/dev/null 2>&1 || missing="$missing Node.js (Debian package nodejs);"
[ -d node_modules/playwright-core ] || missing="$missing playwright-core (run \`npm ci\` in tests/browser);"
browser=""
for c in "${CHROMIUM:-}" chromium chromium-browser /usr/bin/chromium; do
  [ -n "$c" ] || continue
  p=$(command -v "$c" 2>/dev/null) && [ -x "$p" ] && { browser=$p; break; }
done
[ -n "$browser" ] || missing="$missing chromium (Debian package chromium, or set CHROMIUM);"
if [ -n "$missing" ]; then
  echo "the browser test needs:$missing" >&2
  exit 1
fi
echo "$browser"
