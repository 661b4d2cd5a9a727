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
const pie = await sbx.runCode(
  "plt.pie([90, 10], labels=['a', 'b'], startangle=90)\nplt.show()"
)
const pieChart = pie.results[0].chart
out.pie = { title: pieChart?.title, angles: pieChart?.elements.map((e) => e.angle) }
const shown = await sbx.runCode(
  "from PIL import Image\nImage.new('RGB', (4, 4)).show()\nImage.new('RGB', (4, 4)).save('s.png')"
)
out.images = shown.results.map((r) => Buffer.from(r.png, 'base64').subarray(1, 4).toString())
out.data = (await sbx.runCode("import pandas as pd\npd.DataFrame({'a': [1]})")).results[0].data
out.js = (await sbx.runCode("'4' + 2", { language: 'js' })).text
// An execution's env var after a JavaScript error, then gone for the next cell.
const thrown = await sbx.runCode('throw new Error("x")', { language: 'js', envs: { MINE: 'y' } })
const after = await sbx.runCode("process.env.MINE ?? 'unset'", { language: 'js' })
out.jsEnv = [thrown.error?.name, after.text]
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
