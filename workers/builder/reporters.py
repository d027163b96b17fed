"""kiln's own per-test reporters for the JavaScript runners that have no reporter writing to a file kiln could choose:
uvu (no reporter API at all: its installed copy gets two lines, one after each test's verdict) and jasmine (a helper
adding a reporter next to its console reporter, whose summary stays the count the results are checked against).
Both write TAP lines (``ok N - suite > name``) to the file named by an environment variable; the dependency step
installs them (``install_script``), the test command names the file.

The judged code shares these runners' process, as it shares mocha's with its xunit reporter: what it could forge is
bounded by the check against the runner's printed summary (``reports.printed_summary``) and the exit status.
"""

from __future__ import annotations

import shlex

KILN_JS = "/opt/kiln-js"
UVU_REPORT_ENV = "KILN_UVU_REPORT"
JASMINE_REPORT_ENV = "KILN_JASMINE_REPORT"
JASMINE_HELPER = f"{KILN_JS}/jasmine-report.cjs"

# Run in the project directory after the install: uvu's runner prints a dot per test and names only failures; a call
# after each verdict (``write(PASS)`` / ``write(FAIL)`` in its runner) writes the test's name and outcome. A copy that
# lacks either line (another uvu) is left alone, and its results stay unread.
_UVU_PATCH = r"""
const fs = require('fs');
for (const f of ['node_modules/uvu/dist/index.js', 'node_modules/uvu/dist/index.mjs']) {
  if (!fs.existsSync(f)) continue;
  let s = fs.readFileSync(f, 'utf8');
  if (s.includes('__kilnUvu') || !s.includes('write(PASS);') || !s.includes('write(FAIL);')) continue;
  const head = f.endsWith('.mjs') ? "import * as __kilnFs from 'fs';\n" : "const __kilnFs = require('fs');\n";
  s = head + s.replace('write(PASS);', 'write(PASS); __kilnUvu(name, test.name, true);')
    .replace('write(FAIL);', 'write(FAIL); __kilnUvu(name, test.name, false);')
    + "\nlet __kilnUvuN = 0;\nfunction __kilnUvu(suite, name, ok) {\n"
    + "  const f = process.env.KILN_UVU_REPORT; if (!f) return;\n"
    + "  const label = ((suite ? suite + ' > ' : '') + String(name)).replace(/\\s+/g, ' ');\n"
    + "  __kilnFs.appendFileSync(f, (ok ? 'ok ' : 'not ok ') + (++__kilnUvuN) + ' - ' + label + '\\n');\n}\n";
  fs.writeFileSync(f, s);
}
"""

# Loaded with --helper: jasmine's console reporter stays (and prints "N specs, M failures"); this one adds a line per
# spec. Pending and excluded specs are skips.
_JASMINE_HELPER = r"""
const fs = require('fs');
let n = 0;
jasmine.getEnv().addReporter({ specDone(r) {
  const f = process.env.KILN_JASMINE_REPORT; if (!f) return;
  const verdict = r.status === 'passed' ? 'ok' : r.status === 'failed' ? 'not ok' : 'ok';
  const skip = r.status === 'passed' || r.status === 'failed' ? '' : ' # SKIP';
  fs.appendFileSync(f, verdict + ' ' + (++n) + ' - ' + String(r.fullName).replace(/\s+/g, ' ') + skip + '\n');
} });
"""


def install_script() -> str:
    """Shell for the dependency step (in the project directory, after the install): the jasmine helper in place,
    uvu's copy given its reporter lines."""
    return (f"mkdir -p {KILN_JS} && printf %s {shlex.quote(_JASMINE_HELPER)} > {JASMINE_HELPER} && "
            f"node -e {shlex.quote(_UVU_PATCH)}")
