"""Benchmark: ckptfix convert/inspect against cp, `import torch`, and the scripts users write today.

Not a test. Creates a synthetic DDP checkpoint (keys ``module.layers.N.weight``) of --size-gb made
of tensors of tens of MB, plus a variant with 20,000 small tensors, then runs every command side
by side in alternating rounds and reports the median wall time and peak anonymous memory
(RssAnon sampled from /proc/PID/status), as ratios to ``import torch`` + ``cp`` + fsync measured in
the same run, each command after a ``sync`` and a pause (--settle, 1 s) so one command's writeback doesn't land on
the next, and its output deleted once measured (kept, the outputs fill the page cache and evict the sources).
Replaces the first section of bench/RESULTS.md (the sections after it are other benches').

    python bench/convert.py --size-gb 2 --rounds 3 --dir /tmp/ckptfix-bench
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from measure import busy, measure  # bench/measure.py (this script's folder is on sys.path)

HERE = Path(__file__).resolve().parent
PY = sys.executable
CKPTFIX = [PY, "-m", "ckptfix"]

USER_PTH = """
import sys, torch
sd = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
torch.save({k.replace("module.", ""): v for k, v in sd.items()}, sys.argv[2])
"""
USER_ST = """
import sys, torch
from safetensors.torch import save_file
sd = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
save_file({k.replace("module.", ""): v.contiguous() for k, v in sd.items()}, sys.argv[2])
"""
USER_MMAP = """
import os, sys, torch
from safetensors.torch import save_file
sd = torch.load(sys.argv[1], map_location="cpu", weights_only=True, mmap=True)
save_file({k.replace("module.", ""): v.contiguous() for k, v in sd.items()}, sys.argv[2])
fd = os.open(sys.argv[2], os.O_RDONLY); os.fsync(fd); os.close(fd)
"""
CP_FSYNC = 'cp "$1" "$2" && sync "$2"'
#: the --sign pair's floor: one SHA-256 of the file (OpenSSL's, through hashlib: coreutils' sha256sum may lack SHA-NI)
SHA256 = "import hashlib, sys; hashlib.file_digest(open(sys.argv[1], 'rb'), 'sha256')"
#: the library in a process that has already imported torch: only the call is timed (printed as call_s=)
API_CALL = """
import sys, time, torch, ckptfix
start = time.perf_counter()
ckptfix.convert(sys.argv[1], sys.argv[2], force=True)
print(f"call_s={time.perf_counter() - start}")
"""


def make_checkpoints(workdir: Path, size_gb: float, small: int, sign_gb: float) -> dict[str, Path]:
    import torch

    big = workdir / "ddp_big.pth"
    sized = workdir / f"ddp_{sign_gb:g}gb.pth"  # the --sign pair's (issue 30: 1 GB)
    numel = 20 * 2**20 // 4
    for path, gb in ((big, size_gb), (sized, sign_gb)):
        if not path.exists():
            n_tensors = max(1, round(gb * 1024 / 20))  # 20 MiB tensors
            g = torch.Generator().manual_seed(0)
            sd = {f"module.layers.{i}.weight": torch.randn(numel // 1024, 1024, generator=g) for i in range(n_tensors)}
            torch.save(sd, path)
            del sd
    many = workdir / "ddp_many.pth"
    if not many.exists():
        sd = {f"module.blocks.{i}.weight": torch.full((32, 32), float(i)) for i in range(small)}
        torch.save(sd, many)
    st = workdir / "ddp_big.safetensors"
    if not st.exists():
        subprocess.run([*CKPTFIX, "convert", str(big), str(st), "--to", "keep", "--quiet"], check=True)
    return {"big": big, "many": many, "st": st, "sized": sized}


SIGNED = "ckptfix convert pth->safetensors --sign"
#: the --sign pair: the same convert of the --sign-gb checkpoint without and with --sign, and SHA-256's floor
SIGN_PLAIN, SIGN_SIGNED, SIGN_FLOOR = ("sign pair: ckptfix convert pth->safetensors",
                                       "sign pair: ckptfix convert pth->safetensors --sign",
                                       "sign pair: SHA-256 of the checkpoint (hashlib, one core)")


def make_key(workdir: Path) -> Path | None:
    """An EC P-256 key for the ``--sign`` row, where model-signing (ckptfix[sign]) is installed; else no row."""
    try:
        import model_signing  # noqa: F401
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec
    except ImportError:
        print("model-signing not installed (pip install 'ckptfix[sign]'): no --sign row", file=sys.stderr)
        return None
    key = workdir / "sign-key.pem"
    key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return key


def commands(files: dict[str, Path], out: Path, key: Path | None = None) -> dict[str, list[str]]:
    big, many, st, sized = str(files["big"]), str(files["many"]), str(files["st"]), str(files["sized"])
    signed = {SIGNED: [*CKPTFIX, "convert", big, str(out / "signed.safetensors"), "--sign", str(key), "--force",
                       "--quiet"],
              SIGN_PLAIN: [*CKPTFIX, "convert", sized, str(out / "pair.safetensors"), "--force", "--quiet"],
              SIGN_SIGNED: [*CKPTFIX, "convert", sized, str(out / "pair-signed.safetensors"), "--sign", str(key),
                            "--force", "--quiet"],
              SIGN_FLOOR: [PY, "-c", SHA256, sized]} if key else {}
    return {
        "python -c pass": [PY, "-c", "pass"],
        "cp + fsync": ["sh", "-c", CP_FSYNC, "sh", big, str(out / "copy.pth")],
        "import torch": [PY, "-c", "import torch"],
        "user: torch.load(mmap)+replace+save_file+fsync": [PY, "-c", USER_MMAP, big, str(out / "user_mmap.safetensors")],
        "user: torch.load+replace+torch.save": [PY, "-c", USER_PTH, big, str(out / "user.pth")],
        "user: torch.load+replace+save_file": [PY, "-c", USER_ST, big, str(out / "user.safetensors")],
        "ckptfix convert pth->pth": [*CKPTFIX, "convert", big, str(out / "c.pth"), "--force", "--quiet"],
        "ckptfix convert pth->safetensors": [*CKPTFIX, "convert", big, str(out / "c.safetensors"), "--force", "--quiet"],
        **signed,
        "ckptfix convert safetensors->pth": [*CKPTFIX, "convert", st, str(out / "s.pth"), "--force", "--quiet"],
        "ckptfix convert pth->safetensors --dtype bf16": [*CKPTFIX, "convert", big, str(out / "bf16.safetensors"),
                                                         "--dtype", "bf16", "--force", "--quiet"],
        "ckptfix.convert() pth->pth, torch imported (call only)": [PY, "-c", API_CALL, big, str(out / "api.pth")],
        "ckptfix.convert() pth->safetensors, torch imported (call only)": [PY, "-c", API_CALL, big,
                                                                           str(out / "api.safetensors")],
        "ckptfix inspect": [*CKPTFIX, "inspect", big],
        "20k small: user torch.load+replace+torch.save": [PY, "-c", USER_PTH, many, str(out / "many_user.pth")],
        "20k small: ckptfix convert pth->pth": [*CKPTFIX, "convert", many, str(out / "many.pth"), "--force", "--quiet"],
        "20k small: ckptfix convert pth->safetensors": [*CKPTFIX, "convert", many, str(out / "many.safetensors"), "--force",
                                                        "--quiet"],
        "20k small: ckptfix.convert() pth->pth, torch imported (call only)": [PY, "-c", API_CALL, many,
                                                                              str(out / "many_api.pth")],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--small-tensors", type=int, default=20_000)
    ap.add_argument("--sign-gb", type=float, default=1.0, help="the --sign pair's checkpoint (issue 30: 1 GB)")
    ap.add_argument("--busy", type=int, default=0, help="CPU-bound processes spinning through every round (a machine "
                    "whose cores are shared); write the table elsewhere with --results")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=1.0, help="seconds to pause after a sync before each command")
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir, removed after)")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args()
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="ckptfix-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "out"
    out.mkdir(exist_ok=True)
    try:
        files = make_checkpoints(workdir, args.size_gb, args.small_tensors, args.sign_gb)
        cmds = commands(files, out, make_key(workdir))
        runs: dict[str, list[tuple[float, int]]] = {name: [] for name in cmds}
        spinners = busy(args.busy)
        try:
            rounds(args, cmds, runs, out)
        finally:
            for p in spinners:
                p.kill()
        report = render(runs, files, args)
        print(report)
        old = args.results.read_text() if args.results.exists() else ""
        later = old[old.index("\n## "):] if "\n## " in old else ""  # other benches' sections stay
        args.results.write_text(report.rstrip("\n") + "\n" + later)
    finally:
        if args.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def rounds(args: argparse.Namespace, cmds: dict[str, list[str]], runs: dict[str, list[tuple[float, int]]],
           out: Path) -> None:
    """Every command once a round, the order alternating; each output deleted once measured."""
    for r in range(args.rounds):
        names = list(cmds) if r % 2 == 0 else list(reversed(cmds))
        for name in names:
            runs[name].append(measure(cmds[name], settle=args.settle))
            for written in out.iterdir():  # each output dropped at once: GiBs of them left in the page cache
                shutil.rmtree(written) if written.is_dir() else written.unlink()  # push the sources out
            print(f"round {r + 1}: {name}: {runs[name][-1][0]:.2f} s", file=sys.stderr)


def render(runs: dict[str, list[tuple[float, int]]], files: dict[str, Path], args: argparse.Namespace) -> str:
    med = {n: statistics.median(w for w, _ in v) for n, v in runs.items()}
    peak = {n: max(m for _, m in v) for n, v in runs.items()}
    base = med["import torch"] + med["cp + fsync"]
    bare = peak["python -c pass"]
    torch_mem = peak["import torch"]
    size = files["big"].stat().st_size
    lines = [
        "# ckptfix conversion benchmark",
        "",
        f"`python bench/convert.py --size-gb {args.size_gb} --rounds {args.rounds} --settle {args.settle:g}` "
        f"on {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}; checkpoint {size / 2**30:.2f} GiB "
        f"({len(list(runs))} commands × {args.rounds} alternating rounds, median wall, max peak RssAnon; page cache warm"
        + (f"; {args.busy} CPU-bound processes spinning throughout" if args.busy else "") + ").",
        "",
        f"Baseline = `import torch` + `cp` + fsync = {base:.2f} s; each command after `sync` + {args.settle:g} s pause. Memory: "
        f"peak RssAnon minus a bare `import torch` process ({torch_mem / 2**20:.0f} MiB) and minus `python -c pass` "
        f"({bare / 2**20:.0f} MiB).",
        "",
        "| command | wall (s) | × (import torch + cp + fsync) | RssAnon − import torch (MiB) | RssAnon − python (MiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in runs:
        ratio = med[name] / base
        extra, over_python = (peak[name] - torch_mem) / 2**20, (peak[name] - bare) / 2**20
        lines.append(f"| {name} | {med[name]:.2f} | {ratio:.2f} | {extra:.0f} | {over_python:.0f} |")
    inspect_ratio = med["ckptfix inspect"] / med["import torch"]
    api = {prefix + what: med[f"{prefix}ckptfix.convert() {what}, torch imported (call only)"]
           / med[f"{prefix}ckptfix convert {what}"] for prefix, what in
           (("", "pth->pth"), ("", "pth->safetensors"), ("20k small: ", "pth->pth"))}
    lines += ["", f"`ckptfix inspect` / `import torch` = {inspect_ratio:.2f}. `ckptfix.convert()` called in a process "
              "that has imported torch (the call alone) / the CLI command (whole process): "
              + ", ".join(f"{what} {r:.2f}" for what, r in api.items()) + ".", ""]
    cp = med["cp + fsync"]
    lines[-1:] = ["`ckptfix convert` / `cp` + fsync of the same file (issue 30 item 5: at most 1.15, every record's CRC-32 "
                  "checked and every tensor's digest recorded): "
                  + ", ".join(f"{what} {med[f'ckptfix convert {what}'] / cp:.2f}" for what in
                              ("pth->pth", "pth->safetensors", "safetensors->pth")) + ".", ""]
    if SIGNED in med:
        pair = statistics.median(s / p for (s, _m), (p, _n) in zip(runs[SIGN_SIGNED], runs[SIGN_PLAIN]))
        floor = statistics.median((f + p) / p for (f, _m), (p, _n) in zip(runs[SIGN_FLOOR], runs[SIGN_PLAIN]))
        lines[-1:] = [f"`convert --sign` / the same `convert` (pth->safetensors, torch-free, its output hashed behind "
                      f"the copy and signed as an OpenSSF model signature): {args.size_gb:g} GB "
                      f"{med[SIGNED] / med['ckptfix convert pth->safetensors']:.2f} (ratio of medians); "
                      f"{args.sign_gb:g} GB **{pair:.2f}** (median of per-round ratios; issue 30: at most 1.25). "
                      f"Beside it: (one SHA-256 of the checkpoint + the plain convert) / the plain convert = {floor:.2f}, a "
                      f"hash after the copy; a hash beside the copy is bounded below by the SHA-256 alone, "
                      f"{med[SIGN_FLOOR]:.2f} s (its process included) against the plain convert's "
                      f"{med[SIGN_PLAIN]:.2f} s.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
