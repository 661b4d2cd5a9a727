// tslab's kernel (JavaScript with --js, else TypeScript) whose cell value is the cell's result,
// as E2B's JavaScript kernel gives it, not a line of stdout:
//
//   node tslab_kernel.js <tslab's package directory> --config-path <connection file> [--js]
//
// tslab logs a cell's value through the console it gives its executor, which logs nothing else
// (the cell's own console.log is the global one): that console's log shows the value as a
// display marked as the cell's result, which the server sends as its main result (events.py).
"use strict";

const path = require("path");
const util = require("util");

const [tslab, ...args] = process.argv.slice(2);
const executor = require(path.join(tslab, "dist", "executor.js"));
const jupyter = require(path.join(tslab, "dist", "jupyter.js"));
const { startKernel } = require(path.join(tslab, "dist", "main.js"));

function show(value) {
  // As Node's REPL and E2B's kernel show a value (the server unquotes a string's text).
  const data = { "text/plain": util.inspect(value) };
  jupyter.lastWriteDisplayData({ data, metadata: { "aenv/main_result": true }, transient: {} }, false);
}

const create = executor.createExecutor;
executor.createExecutor = (rootDir, convs, console) =>
  create(rootDir, convs, { ...console, log: show });

const configPath = args[args.indexOf("--config-path") + 1];
// Not a tslab found in the working directory's node_modules: it would not show values so.
startKernel({ configPath, enableFindLocal: false, jsKernel: args.includes("--js") });
