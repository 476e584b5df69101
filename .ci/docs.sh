#!/usr/bin/env bash
# CI's docs step (.ci/run): the site built with mkdocs --strict (a broken link or anchor, a page missing from the nav,
# or an API page whose object does not import fails), then every page opened in headless chromium
# (tests/test_docs_browser.py: the nav, the rendered code, screenshots in build/docs-site/_browser/). Without chromium
# on the PATH: under CI=true a failure naming it, else a warning and the browser check skips.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=.ci/lib.sh
. .ci/lib.sh
command -v chromium >/dev/null || missing chromium "no chromium on the PATH (apt-get install -y chromium)"
site=build/docs-site
rm -rf "$site"
# (not --quiet: it drops the warnings that --strict counts, and the build would pass with broken links)
NO_MKDOCS_2_WARNING=1 python3 -m mkdocs build --strict --site-dir "$site"
# every page of that site opened in headless chromium: the nav, the rendered code, the screenshots
DOCS_BROWSER_SITE="$site" DOCS_BROWSER_BUILT=1 python3 -m pytest -q -p no:cacheprovider -rs tests/test_docs_browser.py
