#!/bin/sh
# The dashboard's browser libraries (src/aenv/dashboard/package.json: xterm.js and uPlot),
# installed from npm at the versions package-lock.json pins and copied into static/vendor/, which
# the node serves: a page loads nothing from another origin. Rebuilt by `make install` when the
# lock file changes.
set -eu
dir=$(dirname "$0")/../src/aenv/dashboard
npm ci --prefix "$dir" --no-audit --no-fund --ignore-scripts --loglevel=error
vendor=$dir/static/vendor
rm -rf "$vendor" && mkdir -p "$vendor"
cp "$dir/node_modules/@xterm/xterm/lib/xterm.js" "$dir/node_modules/@xterm/xterm/css/xterm.css" \
  "$dir/node_modules/@xterm/addon-fit/lib/addon-fit.js" \
  "$dir/node_modules/uplot/dist/uPlot.iife.min.js" "$dir/node_modules/uplot/dist/uPlot.min.css" \
  "$vendor/"
