"""Image models from tiny configs (random weights): Hugging Face, timm, torchvision.

Each builder returns ``nn.Module`` mapping images (n, 3, 16, 16) to logits (n, K). BatchNorm
mixes the samples of a batch, so the BatchNorm ResNet is in the table to be *refused* (with
``fix_model``'s advice); the others use GroupNorm, as DP training does (Opacus' ``fix``).

Beside ViT, ConvNeXt, ResNet and MobileNet, each of the Hugging Face models below covers a
family of its own (the vision survey's findings): Swin-V2 (windows flattened into dim 0, a
position-bias MLP on a constant table whose in-place ReLU writes into a Linear's view output:
``per_sample/views.py``), ConvNeXt-V2 (global response normalisation, parameters of
shape (1, 1, 1, C): ``rules/affine.py``), BiT (weight-standardised convolutions) and
Data2Vec-Vision (relative position bias, layer-scale lambdas, embeddings returning
``(embeddings, (height, width))``: ``recording.odd_outputs``).
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


def hf_image(kind: str, **config):
    """A Hugging Face ``<kind>ForImageClassification`` from ``<kind>Config(**config)``."""
    transformers = import_transformers()
    cfg = getattr(transformers, f"{kind}Config")(num_labels=CLASSES, **config)
    return Logits(getattr(transformers, f"{kind}ForImageClassification")(cfg).eval())


def hf_swinv2():
    """Swin-V2: windows flattened into dim 0, a continuous position-bias MLP on a constant
    table (its ReLU in place on a Linear's view output), a logit scale per head."""
    return hf_image("Swinv2", image_size=sizes.IMAGE[sizes.current()], patch_size=2,
                    embed_dim=sizes.width(8), depths=[2, 1],
                    num_heads=[1, 2], window_size=2, drop_path_rate=0.0)


def hf_convnextv2():
    """ConvNeXt-V2: global response normalisation, weight and bias of shape (1, 1, 1, C)."""
    return hf_image("ConvNextV2", patch_size=2, hidden_sizes=[sizes.width(8), sizes.width(16)],
                    depths=[1, 1],
                    num_stages=2)


def hf_bit():
    """BiT: weight-standardised convolutions (the weight transformed inside forward)."""
    return hf_image("Bit", embedding_size=sizes.width(8),
                    hidden_sizes=[sizes.width(8), sizes.width(16)], depths=[1, 1], num_groups=2,
                    layer_type="preactivation")


def hf_data2vec_vision():
    """Data2Vec-Vision (BEiT's family): relative position bias, layer-scale lambdas, and an
    embeddings layer that returns ``(embeddings, (height, width))``."""
    return hf_image("Data2VecVision", image_size=sizes.IMAGE[sizes.current()], patch_size=4,
                    **sizes.scaled(dict(hidden_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, intermediate_size=32)),
                    use_relative_position_bias=True, layer_scale_init_value=0.1,
                    drop_path_rate=0.0)


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
    "timm_resnet_bn": lambda: timm_resnet(nn.BatchNorm2d),  # eval mode, as fine-tuned: its
    # statistics frozen, a per-channel affine map (refused by type until 2026-11-30; in
    # training mode still refused: tests/per_sample/test_frozen_statistics.py)
    "tv_resnet18_gn": torchvision_resnet18_gn, "tv_mobilenet_v3_gn": torchvision_mobilenet_v3_gn,
    "swinv2": hf_swinv2, "convnextv2": hf_convnextv2, "bit": hf_bit,
    "data2vec_vision": hf_data2vec_vision,
}
"""name -> builder of an images (n, 3, 16, 16) -> (n, K) logits model."""


__all__ = [
    "IMAGES", "Logits", "group_norm", "hf_bit", "hf_convnextv2", "hf_data2vec_vision",
    "hf_image", "hf_swinv2", "hf_vit", "timm_convnext", "timm_resnet", "timm_vit",
    "torchvision_mobilenet_v3_gn", "torchvision_resnet18_gn",
]
