"""Image models from tiny configs (random weights): Hugging Face ViT, timm, torchvision.

Each builder returns ``nn.Module`` mapping images (n, 3, 16, 16) to logits (n, K). BatchNorm
mixes the samples of a batch, so the BatchNorm ResNet is in the table to be *refused* (with
``fix_model``'s advice); the others use GroupNorm, as DP training does (Opacus' ``fix``).
"""

import importlib
from functools import partial

from torch import nn

from workbench.realzoo import sizes
from workbench.realzoo.imports import import_timm, import_torchvision, import_transformers

SIZE, CLASSES = 16, 3


def group_norm(channels: int, **kwargs) -> nn.GroupNorm:
    return nn.GroupNorm(min(4, channels), channels, **kwargs)


class Logits(nn.Module):
    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, x):
        return self.hf(pixel_values=x).logits


def hf_vit():
    transformers = import_transformers()
    cfg = transformers.ViTConfig(image_size=sizes.IMAGE[sizes.current()], patch_size=8,
                                 num_labels=CLASSES, **sizes.scaled(dict(
                                     hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32)))
    return Logits(transformers.ViTForImageClassification(cfg).eval())


def timm_vit():
    import_timm()
    vit = importlib.import_module("timm.models.vision_transformer")
    big = sizes.current() == "base"  # 256 wide (4 heads of 64), 2 blocks, mlp 1024
    return vit.VisionTransformer(img_size=sizes.IMAGE[sizes.current()], patch_size=8,
                                 embed_dim=256 if big else 16, depth=2 if big else 1,
                                 num_heads=4 if big else 2, mlp_ratio=4.0 if big else 2.0,
                                 num_classes=CLASSES).eval()


def timm_convnext():
    import_timm()
    convnext = importlib.import_module("timm.models.convnext")
    dims = tuple(sizes.width(c) for c in (8, 8, 16, 16))
    return convnext.ConvNeXt(depths=(1, 1, 1, 1), dims=dims, patch_size=1,
                             num_classes=CLASSES).eval()


def timm_resnet(norm_layer):
    import_timm()
    resnet = importlib.import_module("timm.models.resnet")
    return resnet.ResNet(resnet.BasicBlock, layers=(1, 1, 1, 1),
                         channels=tuple(sizes.width(c) for c in (8, 8, 16, 16)),
                         stem_width=sizes.width(8), norm_layer=norm_layer,
                         num_classes=CLASSES).eval()


def torchvision_resnet18_gn():
    return import_torchvision().models.resnet18(num_classes=CLASSES,
                                                norm_layer=group_norm).eval()


def torchvision_mobilenet_v3_gn():
    return import_torchvision().models.mobilenet_v3_small(
        num_classes=CLASSES, width_mult=0.25 * sizes.WIDTH[sizes.current()],
        norm_layer=partial(nn.GroupNorm, 1)).eval()


IMAGES = {
    "vit": hf_vit, "timm_vit": timm_vit, "timm_convnext": timm_convnext,
    "timm_resnet_gn": lambda: timm_resnet(group_norm),
    "timm_resnet_bn": lambda: timm_resnet(nn.BatchNorm2d),
    "tv_resnet18_gn": torchvision_resnet18_gn, "tv_mobilenet_v3_gn": torchvision_mobilenet_v3_gn,
}
"""name -> builder of an images (n, 3, 16, 16) -> (n, K) logits model."""


__all__ = [
    "IMAGES", "Logits", "group_norm", "hf_vit", "timm_convnext", "timm_resnet", "timm_vit",
    "torchvision_mobilenet_v3_gn", "torchvision_resnet18_gn",
]
