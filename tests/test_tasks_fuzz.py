"""Property/fuzz test: every verifier survives hostile completions.

Each reward gets ~2,000 random strings (random.Random(0)) plus crafted ones
(megabyte strings, unbalanced / deeply nested braces and parentheses,
``9**9**9``, huge integers, division by zero, unicode digits, code
snippets), each raw, boxed, in answer tags and both. Every call must return
a float in the task's range within CPU_BOUND_S CPU seconds (not wall-clock: load from other
processes does not count; generous, a linear verifier takes milliseconds and math-verify stops at
its 0.5 s deadline), raise nothing and execute nothing,
with and without the ``anti_short_boxed`` reward term (which is also fuzzed on
its own, with the same corpus).
Run with ``-s`` to see the size and the slowest call.
"""

from __future__ import annotations

import builtins
import os
import random
import subprocess
import time

import pytest

from stabledrl_mcore.tasks import anti_short_boxed_bonus, get_task

N_RANDOM = 2000
CPU_BOUND_S = 5.0
MB = 1 << 20
TOKENS = [str(d) for d in range(10)] + [
    "+",
    "-",
    "*",
    "/",
    "**",
    "(",
    ")",
    "{",
    "}",
    "[",
    "]",
    "\\{",
    "\\}",
    "\\boxed{",
    "\\boxed",
    "<answer>",
    "</answer>",
    "\\frac",
    "\\frac{",
    "^",
    "^{",
    "_",
    " ",
    "\n",
    "x",
    "y",
    "\\pi",
    "\\sqrt{",
    "\\infty",
    ",",
    ".",
    "=",
    "$",
    "\\text{",
    "\\left(",
    "\\right)",
    "\\cdot",
    "!",
    "%",
    "\u0667",
    "\uff11",
    "\u2212",
    "\u00f7",
    "\u00d7",
    "__",
    "import",
    "os",
    "'",
    '"',
    "\\",
    "#### ",
    "e",
    "1e999",
    "0x",
    "\x00",
    "\ud800",
    "9" * 50,
]


def crafted(marker_file: str) -> list[str]:
    """Hand-written hostile answers (wrapped in contexts by ``corpus``)."""
    pwn = f"__import__('os').system('touch {marker_file}')"
    return [
        "",
        " ",
        "a" * MB,
        "{" * MB,
        "}" * MB,
        "(" * MB,
        ")" * MB,
        "\\boxed{" * (MB // 7),
        "\\boxed{" + "{" * MB,
        "<answer>" * (MB // 8),
        "</answer>" * (MB // 9),
        "1" * MB,
        "1234" * (MB // 4),
        "{" * 500 + "1" + "}" * 500,
        "(" * 199 + "1" + ")" * 199,
        "(" * 60 + "3+5+7" + ")" * 60,
        "-" * 199 + "3",
        "((((1+2)",
        "1+2))))",
        "{{{1}",
        "}}}{",
        "\\boxed{\\boxed{\\boxed{",
        "\\frac{1}{",
        "\\frac{{{{",
        "9**9**9",
        "10**10**10",
        "2**2**2**2**2**2",
        "9^{9^{9}}",
        "9^9^9^9",
        "10^{10^{10}}",
        "(10^{100})!",
        "100000!",
        "\\binom{10^{9}}{10^{5}}",
        "10^{1000000}",
        "99999999999^{99999999}",
        "9" * 5000,
        "9" * 100000,
        "1" + "0" * 4400,
        "-" + "9" * 300,
        "1e999999",
        "1e308*10",
        "0x1F",
        "1_000",
        "1/0",
        "3/(5-5)",
        "(1-1)/(1-1)",
        "\\frac{1}{0}",
        "0/0",
        "3 / 0 + 5 + 7",
        "\u0667\u0662",
        "\uff11\uff12\uff13",
        "\u0663 + \u0665 + \u0667",
        "\u00b2",
        "\u2167",
        "\U0001d7d9\U0001d7da",
        pwn,
        f"<answer>{pwn}</answer>",
        "open('/etc/passwd').read()",
        "lambda: 0",
        "exec('import os')",
        "().__class__.__bases__[0].__subclasses__()",
        "import os; os.system('true')",
        "```python\nimport os\nos.system('true')\n```",
        "eval('1+1')",
        "__builtins__",
        "x.__class__",
        "\x00" * 100,
        "\ud800\udfff",
        "NaN",
        "nan",
        "inf",
        "-inf",
        "True",
        "None",
        "[]",
        "{}",
        "...",
        "\\infty",
        "\\sqrt{-1}",
        "\\int_0^1 x dx",
        "\\sum_{n=1}^{\\infty} n",
        "x = ",
        "= 22",
        "3 * 5 + 7 = 22 = 23",
        "1234341221434321",
        "12343412214343210000",
        "1 2 3 4 | 3 4 1 2 | 2 1 4 3 | 4 3 2 1",
        "#### 72",
        "72",
        "$72.00",
        "72.",
        "-0",
        "+-+-1",
        "1,2,3,4,5,6,7,8,9,0" * 100,
    ]


def random_string(rng: random.Random) -> str:
    n = rng.choice([0, 1, 3, 8, 20, 60, 200])
    return "".join(rng.choice(TOKENS) for _ in range(rng.randint(0, n)))


def corpus(marker_file: str) -> list[str]:
    rng = random.Random(0)
    out = [random_string(rng) for _ in range(N_RANDOM)]
    out = [f"<answer>{s}</answer>" if i % 4 == 1 else s for i, s in enumerate(out)]  # reach the parsers
    for s in crafted(marker_file):
        out += [s, f"\\boxed{{{s}}}", f"<answer>{s}</answer>", f"Thus \\boxed{{{s}}}.\n<answer>{s}</answer>"]
    return out


REFERENCES = {
    "gsm8k": ["72", "1600", "-7"],
    "math500": ["\\frac{14}{3}", "\\left( 3, \\frac{\\pi}{2} \\right)", "x^2 + 2x + 1"],
    "countdown": [{"numbers": [3, 5, 7], "target": 22}, {"numbers": [1, 3, 4, 6], "target": 24}],
    "sudoku": [{"puzzle": "1030040220404300", "solution": "1234341221434321"}],
}


@pytest.mark.parametrize("options", [{}, {"anti_short_boxed": True}], ids=["base", "anti_short_boxed"])
@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_verifiers_survive_hostile_input(name, options, tmp_path, monkeypatch):
    marker = tmp_path / "pwned_x"
    executed: list[str] = []

    def forbid(what):
        def _hook(*args, **kwargs):
            executed.append(f"{what}{args!r:.80}")
            raise RuntimeError(f"{what} called from a verifier")

        return _hook

    monkeypatch.setattr(os, "system", forbid("os.system"))
    monkeypatch.setattr(subprocess, "Popen", forbid("subprocess.Popen"))
    real_eval, real_exec = builtins.eval, builtins.exec

    def watch(real, what):
        def _hook(source, *args, **kwargs):
            if "pwned" in str(source) or "__import__" in str(source):
                executed.append(f"{what}({str(source)[:80]!r})")
            return real(source, *args, **kwargs)

        return _hook

    monkeypatch.setattr(builtins, "eval", watch(real_eval, "eval"))
    monkeypatch.setattr(builtins, "exec", watch(real_exec, "exec"))

    task = get_task(name, **options)
    lo, hi = task.reward_range
    assert hi == (2.0 if options else 1.0)
    strings = corpus(str(marker))
    refs = REFERENCES[name]
    task.reward("warm-up \\boxed{1}", refs[0])  # one-off imports are not a per-call cost
    slowest = (0.0, "")
    budget_start = time.process_time()
    for i, s in enumerate(strings):
        t0 = time.process_time()
        value = task.reward(s, refs[i % len(refs)])
        task.extract_answer(s)
        dt = time.process_time() - t0
        assert isinstance(value, float) and lo <= value <= hi, (value, s[:80])
        assert dt < CPU_BOUND_S, f"{name}: {dt:.3f} CPU s on {s[:80]!r}"
        if dt > slowest[0]:
            slowest = (dt, s)
    total = time.process_time() - budget_start
    print(
        f"\n[fuzz] {name} {options}: {len(strings)} strings ({N_RANDOM} random), total {total:.1f} CPU s, "
        f"slowest {slowest[0] * 1000:.0f} CPU ms on {slowest[1][:60]!r} (len {len(slowest[1])})"
    )
    assert not marker.exists(), "a verifier executed model output"
    assert not executed, executed


def test_anti_short_boxed_term_survives_hostile_input(tmp_path):
    slowest = (0.0, "")
    for s in corpus(str(tmp_path / "pwned_x")):
        t0 = time.process_time()
        value = anti_short_boxed_bonus(s)
        dt = time.process_time() - t0
        assert value in (0.0, 1.0), s[:80]
        assert dt < CPU_BOUND_S, f"{dt:.3f} CPU s on {s[:80]!r}"
        slowest = max(slowest, (dt, s))
    print(
        f"\n[fuzz] anti_short_boxed: slowest {slowest[0] * 1000:.0f} CPU ms on {slowest[1][:60]!r} (len {len(slowest[1])})"
    )
