"""Attacks on "never run code the user did not name" (round 3): a file in the current folder
named like the installed module a spec names, and factories that need arguments."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch import nn

from hookscope.errors import SpecError
from hookscope.zoo.models import load_model


def test_a_file_in_the_current_folder_never_shadows_the_module_a_spec_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "MARKER"
    (tmp_path / "tabnanny.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "tabnanny", raising=False)
    with pytest.raises(SpecError, match=r"'tabnanny:check' needs the argument file, but a model "
                                        r"spec calls it with none"):
        load_model("tabnanny:check")  # the standard library's tabnanny, not the folder's
    assert not marker.exists()
    assert sys.modules["tabnanny"].__file__ != str(tmp_path / "tabnanny.py")


def test_a_package_only_in_the_current_folder_is_still_found(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hookscope_attack_local.py").write_text(
        "from torch import nn\ndef make(width=3):\n    return nn.Linear(width, 2)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "hookscope_attack_local", raising=False)
    module = load_model("hookscope_attack_local:make").module
    assert isinstance(module, nn.Linear) and module.in_features == 3
    assert str(tmp_path) not in sys.path


def test_a_file_factory_that_needs_arguments_is_named_with_them(tmp_path: Path) -> None:
    file = tmp_path / "net.py"
    file.write_text("from torch import nn\ndef make(width, depth, *rest, act=None, **kw):\n"
                    "    return nn.Linear(width, depth)\n")
    with pytest.raises(SpecError, match=r"needs the arguments width, depth, but"):
        load_model(f"{file}:make")
