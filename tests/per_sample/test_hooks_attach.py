"""``hooks.attach`` / ``detach``: the recorder's hooks without RemovableHandle objects behave as
``register_forward_pre_hook(with_kwargs=True)`` + ``register_forward_hook(with_kwargs=True,
always_call=True, prepend=True)``
and leave the user's own hooks as they were."""

import pytest
import torch
from torch import nn

from workbench.per_sample.hooks import attach, detach


def test_attach_runs_like_registered_hooks_and_detach_leaves_the_users_hooks():
    layer, seen = nn.Linear(3, 2), []
    user = layer.register_forward_hook(lambda m, a, o: seen.append("user"))
    _, key = attach(layer, lambda m, a, k: seen.append(("pre", tuple(k))),
                    lambda m, a, k, o: seen.append(("post", tuple(k))))
    assert key not in (user.id,)
    layer(torch.randn(4, 3))
    assert seen == [("pre", ()), ("post", ()), "user"]  # prepended: forward's own output
    detach(layer, key)
    seen.clear()
    layer(torch.randn(4, 3))
    assert seen == ["user"]
    assert len(layer._forward_hooks) == 1 and not layer._forward_pre_hooks
    assert not layer._forward_pre_hooks_with_kwargs
    assert not layer._forward_hooks_with_kwargs and not layer._forward_hooks_always_called
    user.remove()
    nxt = layer.register_forward_hook(lambda m, a, o: None)
    assert nxt.id > key  # torch's counter moved past ours: no later handle takes our key
    nxt.remove()


def test_attached_hook_is_always_called_when_the_forward_raises():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    layer, seen = Boom(), []
    _, key = attach(layer, lambda m, a, k: seen.append("pre"),
                    lambda m, a, k, o: seen.append("post"))
    with pytest.raises(RuntimeError, match="boom"):
        layer(torch.randn(2))
    assert seen == ["pre", "post"]
    detach(layer, key)
