"""The shared capture mechanism (podmonitor.capture.hooks): hook handles and the MHA fast-path switch."""

from __future__ import annotations

import torch
from torch import nn

from podmonitor.capture.hooks import HookHandles, MHAFastPathOff, mha_fastpath_off


def test_hook_handles_remove_every_hook_once_and_again():
    lin = nn.Linear(3, 3)
    calls: list[str] = []
    hooks = HookHandles()
    hooks.add(lin.register_forward_pre_hook(lambda m, a: calls.append("pre")))
    hooks.add(lin.register_forward_hook(lambda m, a, o: calls.append("post")))
    assert len(hooks) == 2 and hooks
    lin(torch.zeros(1, 3))
    hooks.remove()
    hooks.remove()  # idempotent
    lin(torch.zeros(1, 3))
    assert calls == ["pre", "post"] and not hooks
    assert not lin._forward_pre_hooks and not lin._forward_hooks


def test_fastpath_switch_restores_only_what_it_switched_and_only_if_still_off():
    before = torch.backends.mha.get_fastpath_enabled()
    try:
        torch.backends.mha.set_fastpath_enabled(True)
        a, b = MHAFastPathOff(), MHAFastPathOff()
        a.switch_off()
        assert torch.backends.mha.get_fastpath_enabled() is False and a.active
        b.switch_off()  # saw "off": restoring b alone must not switch it on
        a.restore()  # the first one back: on again
        assert torch.backends.mha.get_fastpath_enabled() is True
        b.restore()  # it is on (someone restored it): b leaves it on, not off
        assert torch.backends.mha.get_fastpath_enabled() is True
        a.restore()  # idempotent
        # a user who switched it on again in between is not overridden
        with mha_fastpath_off():
            torch.backends.mha.set_fastpath_enabled(True)
        assert torch.backends.mha.get_fastpath_enabled() is True
        torch.backends.mha.set_fastpath_enabled(False)
        with mha_fastpath_off():
            pass
        assert torch.backends.mha.get_fastpath_enabled() is False
    finally:
        torch.backends.mha.set_fastpath_enabled(before)

