"""The applications-menu entry and the `fmoe-local` command on PATH, made once by the bootstrap after an install.

Scope: per OS, which files make them (Linux: a .desktop file in the XDG applications folder and a script in
~/.local/bin; macOS: an app bundle in ~/Applications that opens the .command in Terminal, and the same script in
~/.local/bin; Windows: a Start-menu shortcut made by PowerShell and a .cmd in the data folder's bin/, which is added
to the user's PATH), writing them, and never replacing a file that is not ours: every file we write carries MARKER,
and a file at one of our paths without it is left as it is (and named). Standard library only, like bootstrap.py.
It does NOT decide when to run (the bootstrap does: on the first start whose environment is ready, recorded in
DONE_NAME so that entries a user removed are not made again) or remove anything (the README says how).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

MARKER = "fmoe-local launcher: made by installers/bootstrap.py, safe to delete"
DONE_NAME = "shortcuts.json"  # in the data folder: what the first start made, so it is made once
COMMAND = "fmoe-local"


@dataclass(frozen=True)
class Planned:
    path: Path
    text: str
    executable: bool = False
    what: str = ""  # for the user: "applications menu", "command"
    guard: Path | None = None  # the file whose MARKER makes this one ours (a bundle's Info.plist); None: itself


def launcher(repo: Path, system: str) -> Path:
    """The double-click launcher of this copy of the repository: every shortcut starts it (so it updates too)."""
    if system == "Windows":
        return repo / "installers" / "windows" / "fmoe-local.bat"
    if system == "Darwin":
        return repo / "installers" / "macos" / "fmoe-local.command"
    return repo / "installers" / "linux" / "fmoe-local.sh"


def bin_dir(system: str, home: Path, data: Path) -> Path:
    """Where the `fmoe-local` command goes: ~/.local/bin (the XDG/systemd user bin; pipx and uv use it on macOS too),
    on Windows the data folder's bin/, which `windows_path_with` adds to the user's PATH."""
    return data / "bin" if system == "Windows" else home / ".local" / "bin"


def sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def plan(system: str, repo: Path, home: Path, data: Path, env: dict) -> list[Planned]:
    """The files that make the menu entry and the command on `system` (the Windows shortcut is not a text file:
    `windows_start_menu` makes it)."""
    start = launcher(repo, system)
    where = bin_dir(system, home, data)
    if system == "Windows":
        cmd = f'@echo off\r\nrem {MARKER}\r\ncall "{start}" %*\r\n'
        return [Planned(where / f"{COMMAND}.cmd", cmd, False, "command")]
    script = f'#!/bin/sh\n# {MARKER}\nexec {sh_quote(str(start))} "$@"\n'
    planned = [Planned(where / COMMAND, script, True, "command")]
    if system == "Darwin":
        app = home / "Applications" / "fmoe-local.app" / "Contents"
        opener = f"#!/bin/sh\n# {MARKER}\nexec open -a Terminal {sh_quote(str(start))}\n"
        # The bundle is ours when its Info.plist is: nothing is written into someone else's fmoe-local.app.
        planned += [
            Planned(app / "Info.plist", info_plist(), False, "applications"),
            Planned(app / "MacOS" / COMMAND, opener, True, "applications", guard=app / "Info.plist"),
        ]
    else:
        template = repo / "installers" / "linux" / "fmoe-local.desktop"
        text = template.read_text(encoding="utf-8").replace("@LAUNCHER@", str(start)).rstrip("\n")
        apps = data.parent / "applications"  # data is $XDG_DATA_HOME/fmoe-local: the menu reads its applications/
        planned.append(Planned(apps / "fmoe-local.desktop", f"{text}\n# {MARKER}\n", False, "applications menu"))
    return planned


def info_plist() -> str:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">\n'
        f'<plist version="1.0">\n<!-- {MARKER} -->\n<dict>\n'
        f"  <key>CFBundleName</key><string>{COMMAND}</string>\n"
        f"  <key>CFBundleExecutable</key><string>{COMMAND}</string>\n"
        "  <key>CFBundleIdentifier</key><string>local.fmoe-local.launcher</string>\n"
        "  <key>CFBundlePackageType</key><string>APPL</string>\n"
        "</dict>\n</plist>\n"
    )


def ours(path: Path) -> bool:
    """A file we may replace: absent, or one we wrote (it carries MARKER)."""
    if not path.exists() and not path.is_symlink():
        return True
    try:
        return path.is_file() and not path.is_symlink() and MARKER in path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def write(p: Planned) -> None:
    p.path.parent.mkdir(parents=True, exist_ok=True)
    part = p.path.with_name(p.path.name + ".partial")
    part.write_text(p.text, encoding="utf-8", newline="")
    if p.executable:
        part.chmod(0o755)
    part.replace(p.path)


def on_path(folder: Path, env: dict) -> bool:
    parts = [x for x in env.get("PATH", "").split(os.pathsep) if x]
    return any(os.path.normcase(os.path.abspath(x)) == os.path.normcase(str(folder)) for x in parts)


def windows_path_with(folder: Path, user_path: str) -> str | None:
    """The user's PATH (the registry's value) with `folder` appended; None when it is already there."""
    parts = [x for x in user_path.split(";") if x]
    if any(os.path.normcase(x.rstrip("\\/")) == os.path.normcase(str(folder)) for x in parts):
        return None
    return ";".join(parts + [str(folder)])


def windows_add_to_path(folder: Path) -> bool:  # pragma: no cover - Windows only
    """Append `folder` to HKCU\\Environment's Path and tell running programs; False when it was there already."""
    import ctypes
    import winreg

    with winreg.OpenKey(winreg.HKEY_CURRENT_USER, "Environment", 0, winreg.KEY_READ | winreg.KEY_WRITE) as key:
        try:
            value, kind = winreg.QueryValueEx(key, "Path")
        except FileNotFoundError:
            value, kind = "", winreg.REG_EXPAND_SZ
        new = windows_path_with(folder, value)
        if new is None:
            return False
        winreg.SetValueEx(key, "Path", 0, kind, new)
    # New consoles started from Explorer read the new PATH after this broadcast (WM_SETTINGCHANGE, "Environment").
    ctypes.windll.user32.SendMessageTimeoutW(0xFFFF, 0x001A, 0, "Environment", 0x0002, 5000, None)
    return True


def windows_start_menu(start: Path, env: dict, home: Path) -> tuple[Path, str]:  # pragma: no cover - Windows only
    """The Start-menu shortcut (a .lnk, made by PowerShell's WScript.Shell): (its path, what happened)."""
    programs = Path(env.get("APPDATA") or home / "AppData" / "Roaming") / "Microsoft/Windows/Start Menu/Programs"
    link = programs / "fmoe-local.lnk"
    if link.exists() and MARKER.encode("utf-16-le") not in link.read_bytes():
        return link, "kept"
    programs.mkdir(parents=True, exist_ok=True)

    def ps(text: str) -> str:
        return "'" + text.replace("'", "''") + "'"

    script = (
        f"$s = (New-Object -ComObject WScript.Shell).CreateShortcut({ps(str(link))}); "
        f"$s.TargetPath = {ps(str(start))}; $s.WorkingDirectory = {ps(str(start.parent))}; "
        f"$s.Description = {ps(MARKER)}; $s.Save()"
    )
    done = subprocess.run(
        ["powershell", "-NoProfile", "-NonInteractive", "-Command", script], capture_output=True, timeout=60
    )
    return link, "made" if done.returncode == 0 else "failed"


def install(system: str, repo: Path, home: Path, data: Path, env: dict) -> list[str]:
    """Make the menu entry and the command (once: DONE_NAME in `data` records it); sentences for the user."""
    done_file = data / DONE_NAME
    if done_file.exists():
        return []
    said, made = [], []
    for p in plan(system, repo, home, data, env):
        if not ours(p.guard or p.path) or not ours(p.path):
            said.append(f"Left {p.path} as it is: it is not one fmoe-local made (remove it to get ours).")
            continue
        write(p)
        made.append(str(p.path))
    if system == "Darwin":
        app = home / "Applications" / "fmoe-local.app"
        if str(app / "Contents" / "Info.plist") in made:
            said.append(f"Added fmoe-local to your Applications ({app}).")
    elif system == "Windows":  # pragma: no cover - Windows only
        link, how = windows_start_menu(launcher(repo, system), env, home)
        if how == "made":
            made.append(str(link))
            said.append(f"Added fmoe-local to the Start menu ({link}).")
        elif how == "kept":
            said.append(f"Left {link} as it is: it is not one fmoe-local made.")
        else:
            said.append("Could not add fmoe-local to the Start menu (PowerShell failed); start it from this folder.")
    else:
        entry = next(p.path for p in plan(system, repo, home, data, env) if p.what == "applications menu")
        if str(entry) in made:
            said.append(f"Added fmoe-local to your applications menu ({entry}).")
    command = bin_dir(system, home, data)
    if any(Path(m).parent == command for m in made):
        said.append(command_sentence(system, command, env))
    data.mkdir(parents=True, exist_ok=True)
    done_file.write_text(json.dumps({"made": made}, indent=2), encoding="utf-8")
    return said


def command_sentence(system: str, folder: Path, env: dict) -> str:
    """What the user can type now, and what to do when the folder is not on PATH yet."""
    if system == "Windows":  # pragma: no cover - Windows only
        added = windows_add_to_path(folder)
        return f"Added the {COMMAND} command ({folder}); " + (
            "it is on your PATH in consoles opened from now on." if added else "it is on your PATH."
        )
    if on_path(folder, env):
        return f"Added the {COMMAND} command ({folder / COMMAND}): type {COMMAND} in a terminal to start it."
    profile = "~/.zprofile" if system == "Darwin" else "~/.profile"
    return (
        f"Added the {COMMAND} command ({folder / COMMAND}); {folder} is not on your PATH yet: "
        f'add the line  export PATH="$HOME/.local/bin:$PATH"  to {profile} (most Linux systems do this at the '
        "next login by themselves), or type the full path."
    )
