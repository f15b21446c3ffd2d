"""`sluice chat` driven through a pseudo-terminal, as a person at a keyboard drives it.

Run by tests/tests/chat.rs against a real daemon serving SmolLM2 with a 320-token context:
    chat_pty.py SLUICE ADDR HTTP HISTORY_FILE
Each step checks what the screen shows; the conversation the chat holds is checked against
the daemon's HTTP API given the same messages (greedy, so the replies must be equal).
"""
import json
import re
import subprocess
import sys
import time
import urllib.request

import pexpect

SLUICE, ADDR, HTTP, HISTORY = sys.argv[1:5]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
PROMPT = ">>> "


def clean(s):
    return ANSI.sub("", s).replace("\r", "")


def spawn(*extra):
    c = pexpect.spawn(
        SLUICE,
        ["--addr", ADDR, "chat", "--temperature", "0", "--history", HISTORY, "--max-tokens", "24", *extra],
        env={"TERM": "xterm", "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
        encoding="utf-8",
        timeout=60,
        dimensions=(50, 200),
    )
    c.expect_exact("Chatting with smollm2 (context 320 tokens)")
    c.expect_exact(PROMPT)
    return c


def settle(c):
    """Waits until the chat is back at its prompt (/show answers only once it is); returns
    the messages it holds and what the screen showed before."""
    c.sendline("/show")
    c.expect(r"model smollm2 \(context 320 tokens, 24 kept for the reply\); (\d+) messages")
    n, screen = int(c.match.group(1)), clean(c.before)
    c.expect_exact(PROMPT)
    return n, screen


def command(c, line, shows):
    """Sends a slash command; waits for what it shows and the prompt after it."""
    c.sendline(line)
    c.expect_exact(shows)
    c.expect_exact(PROMPT)


def history(c):
    c.sendline("/history json")
    c.expect(r'(\[\{".*\}\])\r?\n')
    msgs = json.loads(clean(c.match.group(1)))
    c.expect_exact(PROMPT)
    return msgs


def status():
    out = subprocess.run([SLUICE, "--addr", ADDR, "status", "--json"], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def chat_http(messages):
    body = json.dumps({"model": "smollm2", "messages": messages, "max_tokens": 24,
                       "temperature": 0}).encode()
    req = urllib.request.Request(HTTP + "/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def check(cond, what):
    if not cond:
        sys.exit(f"FAILED: {what}")


c = spawn()
# Arrow keys edit the line: "Bxb", Left, Backspace, "o" is "Bob".
c.send("My name is Bxb")
c.send("\x1b[D")
c.send("\x7f")
c.send("o\r")
check(settle(c)[0] == 2, "a user message and its reply")
msgs = history(c)
check(msgs[0] == {"role": "user", "content": "My name is Bob"}, f"edited line: {msgs[0]}")

# Slash commands never reach the model.
command(c, "/help", "/clear")
command(c, "/frobnicate", "unknown command /frobnicate")
command(c, "/set temperature warm", "not a number")
check(settle(c)[0] == 2, "commands are not messages")

# Ctrl-C stops a long reply; the daemon frees the sequence; the conversation stays.
command(c, "/set max_tokens 200", "[max_tokens = 200]")
c.sendline("Write a very long story about a dragon who lives in a cave.")
c.expect_exact("lives in a cave.")  # the line as typed
c.expect(r"\n[^\n]*\w+ \w+ \w+ ")  # the reply has begun
t0 = time.time()
c.sendintr()
c.expect_exact("[stopped]")
check(time.time() - t0 < 5, "the reply stopped at once")
deadline = time.time() + 3
while status()["active_sequences"] != 0:
    check(time.time() < deadline, "the daemon still runs the stopped sequence")
    time.sleep(0.1)
c.expect_exact(PROMPT)
c.sendline("/set max_tokens 24")
c.expect_exact(PROMPT)
msgs = history(c)
check(len(msgs) == 4 and msgs[3]["role"] == "assistant" and msgs[3]["content"],
      f"the stopped reply is kept: {msgs}")

# The next turn sends the whole conversation: its reply is the API's for those messages.
c.sendline("Tell me more.")
c.expect_exact(PROMPT)
shown = clean(c.before)
msgs = history(c)
check(len(msgs) == 6, f"six messages: {msgs}")
want = chat_http(msgs[:5])
check(msgs[5]["content"] == want, f"reply {msgs[5]['content']!r} is not the API's {want!r}")
check(want.strip() in shown, f"the reply on screen: {shown!r}")

# Multi-line input: a """ block is one message with its newlines.
c.send('"""first line\r')
c.send('second line"""\r')
settle(c)
msgs = history(c)
check(msgs[6] == {"role": "user", "content": "first line\nsecond line"}, f"multi-line: {msgs[6]}")

# /system and /clear.
command(c, "/system You are terse.", "[system message set]")
command(c, "/clear", "[forgot 8 messages]")
check(history(c) == [{"role": "system", "content": "You are terse."}], "cleared")
c.sendline("/system -")
c.expect_exact(PROMPT)

# A conversation longer than the context is trimmed from its oldest turns and goes on.
para = ("The river carried silt from the mountains to the sea, and every spring the farmers "
        "along its banks watched the water rise and fall with the melting snow. ")
dropped = 0
for i in range(6):
    c.sendline(f"Part {i}: {para * 2}")
    n, screen = settle(c)
    check("error:" not in screen, f"turn {i} failed: {screen!r}")
    dropped += "oldest messages to fit the context of 320 tokens (24 kept for the reply)" in screen
check(dropped >= 2, f"the chat said it trimmed the conversation ({dropped} times)")
msgs = history(c)
check(msgs[0]["content"] != f"Part 0: {para * 2}", "the oldest turn was dropped")
check(msgs[-1]["role"] == "assistant" and msgs[-2]["content"].startswith("Part 5"),
      f"the newest turn and its reply: {msgs[-2:]}")
c.sendline("/exit")
c.expect(pexpect.EOF)
c.close()
check(c.exitstatus == 0, f"/exit exits 0, not {c.exitstatus}")

# History across sessions: Up recalls the last line of the previous session; Ctrl-D leaves
# on a fresh line with status 0.
c = spawn()
c.send("\x1b[A")
c.expect_exact("/exit")
c.send("\x15")  # Ctrl-U: clear the recalled line
c.sendeof()
c.expect(pexpect.EOF)
c.close()
check(c.exitstatus == 0, f"Ctrl-D exits 0, not {c.exitstatus}")
print("ok")
