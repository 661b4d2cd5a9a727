// The npm `@e2b/code-interpreter` SDK against our code interpreter server: debug mode, with
// E2B_SANDBOX_URL naming the server (run by tests/code_interpreter/test_js_sdk.py). Prints one
// JSON object.
import { Sandbox } from '@e2b/code-interpreter'

const out = {}
const sbx = await Sandbox.create({ debug: true })
out.contexts = (await sbx.listCodeContexts()).map((c) => c.language).sort()
await sbx.runCode('x = 41')
const stdout = []
const first = await sbx.runCode("print('hi')\nx + 1", { onStdout: (m) => stdout.push(m.line) })
out.text = first.text
out.stdout = stdout
out.error = (await sbx.runCode('1 / 0')).error?.name
const figure = await sbx.runCode(
  "import matplotlib.pyplot as plt\nplt.bar(['a', 'b'], [1, 2])\nplt.show()"
)
const [chart] = figure.results
out.png = Buffer.from(chart.png, 'base64').subarray(1, 4).toString()
out.chart = { type: chart.chart?.type, values: chart.chart?.elements.map((e) => e.value) }
out.data = (await sbx.runCode("import pandas as pd\npd.DataFrame({'a': [1]})")).results[0].data
out.js = (await sbx.runCode("'4' + 2", { language: 'js' })).text
const shell = await sbx.createCodeContext({ language: 'bash' })
out.bash = (await sbx.runCode('echo $((1 + 2))', { context: shell })).logs.stdout
try {
  await sbx.runCode('import time\nwhile True: time.sleep(0.1)', { timeoutMs: 2000 })
  out.timeout = 'none'
} catch (e) {
  out.timeout = e.name
}
out.kept = (await sbx.runCode('x', { timeoutMs: 30_000 })).text
console.log(JSON.stringify(out))
