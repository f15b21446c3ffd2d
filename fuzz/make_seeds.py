"""Writes the seed corpora of fuzz/corpus/TARGET/ from the committed tiny models: small,
real inputs each target's parser accepts, for libFuzzer to mutate. Run from the repository
root after `cargo build --release` (it packs a tiny model with sluiced for a manifest, and
unpacks its payload with the zstd command):
    python3 fuzz/make_seeds.py
"""
import os
import shutil
import struct
import subprocess
import tempfile

FIX = "tests/fixtures"
OUT = "fuzz/corpus"
# sluiced is wherever cargo puts it (CARGO_TARGET_DIR, build.target-dir or ./target).
SLUICED = os.path.join(subprocess.run(["scripts/target-dir.sh"], check=True, capture_output=True,
                                      text=True).stdout.strip(), "release", "sluiced")


def put(target, name, data):
    os.makedirs(f"{OUT}/{target}", exist_ok=True)
    with open(f"{OUT}/{target}/{name}", "wb") as f:
        f.write(data)


def read(p):
    with open(p, "rb") as f:
        return f.read()


def gguf_header(path):
    """The file up to its tensor data (header, metadata, tensor table) and 64 bytes more."""
    b = read(path)
    # The tensor data is aligned to 32 after the table; find the table's end by parsing.
    pos = 4 + 4
    n_tensors, n_kv = struct.unpack_from("<QQ", b, pos)
    pos += 16

    def string(p):
        (n,) = struct.unpack_from("<Q", b, p)
        return p + 8 + n

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def value(p, t):
        if t == 8:
            return string(p)
        if t == 9:
            (et,) = struct.unpack_from("<I", b, p)
            (n,) = struct.unpack_from("<Q", b, p + 4)
            p += 12
            for _ in range(n):
                p = value(p, et)
            return p
        return p + sizes[t]

    for _ in range(n_kv):
        pos = string(pos)
        (t,) = struct.unpack_from("<I", b, pos)
        pos = value(pos + 4, t)
    for _ in range(n_tensors):
        pos = string(pos)
        (nd,) = struct.unpack_from("<I", b, pos)
        pos += 4 + 8 * nd + 4 + 8
    return b[: pos + 64]


shutil.rmtree(OUT, ignore_errors=True)
for f in ["tiny-llama-q.gguf", "tiny-qwen3.gguf"]:
    h = gguf_header(f"{FIX}/{f}")
    put("gguf", f.replace(".gguf", ""), h)
    put("gguf", f.replace(".gguf", "-cut"), h[: len(h) // 2])

for d in ["tiny-llama", "tiny-gemma3"]:
    st = [x for x in sorted(os.listdir(f"{FIX}/{d}")) if x.endswith(".safetensors")][0]
    b = read(f"{FIX}/{d}/{st}")
    (n,) = struct.unpack_from("<Q", b, 0)
    put("safetensors", d, b[: 8 + n + 32] + b"\0" + read(f"{FIX}/{d}/config.json"))

with tempfile.TemporaryDirectory() as tmp:
    subprocess.run([SLUICED, "pack", f"{FIX}/tiny-llama-q.gguf", "-o",
                    f"{tmp}/s", "--codec", "lz4"], check=True, capture_output=True)
    # The manifest target: 0 then a whole file, or a format version then its payload
    # decompressed (fuzzing::manifest).
    m = read(f"{tmp}/s/manifest.bin")
    version, n = struct.unpack_from("<IQ", m, 8)
    payload = subprocess.run(["zstd", "-d", "-c"], input=m[20:20 + n], check=True,
                             capture_output=True).stdout
    put("manifest", "tiny-llama-q", b"\0" + m)
    put("manifest", "tiny-llama-q-payload", bytes([version]) + payload)

text = b"The quick brown fox jumps over the lazy dog. " * 8
for codec in range(3):
    for width in range(3):
        head = bytes([codec | 0x70, width, 0x00, 0x01, 1, 2, 3, 4])
        put("frame", f"c{codec}-w{width}", head + text)

put("template", "chatml", b"{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    b"<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    b"\0You are helpful.\0Hello!\0Hi there.\0What is 2+2?")
put("template", "loops", b"{% for i in range(10) %}{{ messages[0].content | upper }}{% endfor %}"
    b"\0a\0b")

put("tokenizer", "english", b"Hello world, the history of the printing press begins.")
put("tokenizer", "mixed", "caf\u00e9 \u4f60\u597d \U0001F600 <|im_start|> <s> \t\n  x".encode())

put("openai", "chat", b'{"model":"m","messages":[{"role":"system","content":"Be brief."},'
    b'{"role":"user","content":[{"type":"text","text":"Hi"}]}],"max_tokens":8,'
    b'"temperature":0.7,"top_p":0.9,"stop":["\\n"],"stream":true,'
    b'"stream_options":{"include_usage":true},"logprobs":true,"top_logprobs":2,'
    b'"keep_alive":"5m","seed":1}')
put("openai", "completion", b'{"prompt":["Once upon a time",[1,2,3]],"max_tokens":4,'
    b'"logprobs":1,"presence_penalty":0.5,"frequency_penalty":0.1,"n":1}')


def field(num, wire, payload):
    key = bytes([num << 3 | wire])
    if wire == 2:
        return key + bytes([len(payload)]) + payload
    return key + payload


req = (field(2, 2, b"Once upon a time") + field(4, 0, b"\x10")
       + field(5, 2, field(1, 5, struct.pack("<f", 0.7)) + field(2, 5, struct.pack("<f", 0.9)))
       + field(6, 2, b"\n") + field(9, 2, b"5m"))
put("grpc", "generate", req)
put("grpc", "messages", field(3, 2, field(1, 2, b"user") + field(2, 2, b"Hi!")) + field(9, 2, b"-1"))
print("seeds written to", OUT)
