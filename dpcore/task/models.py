"""Model zoo: the papers' CNNs, a GroupNorm ResNet-18 and a small MLP.

Every model takes any (C, H, W) input and any number of classes, has no BatchNorm (so
Opacus DP-SGD accepts it), and ends with its classifier: the last nn.Linear in
registration order is the head that personalized algorithms keep local.
"""

from __future__ import annotations

import torch
from torch import nn

MODELS = ("cnn-mnist", "cnn-emnist", "cnn-cifar10", "cnn-cifar10-dp2", "resnet18-gn", "mlp")


class ConvNet(nn.Module):
    """`features` (convolutions and pooling), then a flattened MLP `classifier`.

    Inputs smaller than the smallest size the feature layers accept (e.g. 8x8 digits for
    the MNIST CNN) are bilinearly upsampled to that size first (`resize`, no parameters).
    """

    def __init__(
        self, features: nn.Sequential, hidden: tuple[int, ...], input_shape: tuple[int, int, int], num_classes: int
    ):
        super().__init__()
        channels, height, width = input_shape
        side = _min_input_side(features)
        self.resize = (
            nn.Upsample(size=(max(height, side), max(width, side)), mode="bilinear", align_corners=False)
            if min(height, width) < side
            else nn.Identity()
        )
        self.features = features
        with torch.no_grad():
            width_in = features(self.resize(torch.zeros(1, channels, height, width))).numel()
        layers: list[nn.Module] = [nn.Flatten()]
        for units in hidden:
            layers += [nn.Linear(width_in, units), nn.ReLU()]
            width_in = units
        layers.append(nn.Linear(width_in, num_classes))
        self.classifier = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(self.resize(x)))


def _min_input_side(features: nn.Sequential) -> int:
    """Smallest square input side for which every conv/pool layer of `features` has a non-empty output."""
    side = 1
    while not _output_side(features, side):
        side += 1
    return side


def _output_side(features: nn.Sequential, side: int) -> int:
    """Output side of `features` for a square input of side `side` (0: some layer's output is empty)."""
    for layer in features:
        if isinstance(layer, (nn.Conv2d, nn.MaxPool2d)):
            k, s, p = (v[0] if isinstance(v, tuple) else v for v in (layer.kernel_size, layer.stride, layer.padding))
            side = (side + 2 * p - k) // s + 1
            if side < 1:
                return 0
    return side


def cnn_mnist(input_shape: tuple[int, int, int], num_classes: int) -> ConvNet:
    """ALI-DPFL's MNIST / FashionMNIST CNN (its Table V): conv 16@8x8 stride 2 padding 2, max-pool 2x2
    stride 1, conv 32@4x4 stride 2, max-pool 2x2 stride 1, dense 32, dense num_classes.

    The paper does not name the activation: ReLU, as in Opacus' MNIST example of the same network.
    """
    features = nn.Sequential(
        nn.Conv2d(input_shape[0], 16, 8, stride=2, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2, stride=1),
        nn.Conv2d(16, 32, 4, stride=2),
        nn.ReLU(),
        nn.MaxPool2d(2, stride=1),
    )
    return ConvNet(features, (32,), input_shape, num_classes)


def cnn_emnist(input_shape: tuple[int, int, int], num_classes: int) -> ConvNet:
    """DP-FedSAM's EMNIST CNN: two 5x5 convolutions with max pooling, a 512-unit dense layer.

    The paper gives no channel counts or padding: 32 and 64 channels, 'same' padding, 2x2 max
    pooling after each convolution and ReLU, as in the FedAvg paper's CNN (McMahan et al. 2017).
    """
    features = nn.Sequential(
        nn.Conv2d(input_shape[0], 32, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )
    return ConvNet(features, (512,), input_shape, num_classes)


def cnn_cifar10(input_shape: tuple[int, int, int], num_classes: int) -> ConvNet:
    """ALI-DPFL's CIFAR-10 CNN (its Table VI): three blocks of two 3x3 convolutions (32, 64, 128
    filters, stride 1, padding 1) each followed by 2x2 max pooling, dense 128, dense num_classes.

    The paper does not name the activation: ReLU after every convolution and the hidden dense layer.
    """
    layers: list[nn.Module] = []
    channels = input_shape[0]
    for width in (32, 64, 128):
        layers += [
            nn.Conv2d(channels, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        ]
        channels = width
    return ConvNet(nn.Sequential(*layers), (128,), input_shape, num_classes)


def cnn_cifar10_dp2(input_shape: tuple[int, int, int], num_classes: int) -> ConvNet:
    """DP2-FedSAM's CIFAR-10 CNN: three 3x3 convolutions (64, 128, 256 filters) each with 2x2 max
    pooling and ReLU, dense 256, dense 128, dense num_classes.

    No padding, which gives the paper's 667,402 parameters for 3x32x32 inputs and 10 classes.
    """
    layers: list[nn.Module] = []
    channels = input_shape[0]
    for width in (64, 128, 256):
        layers += [nn.Conv2d(channels, width, 3), nn.ReLU(), nn.MaxPool2d(2)]
        channels = width
    return ConvNet(nn.Sequential(*layers), (256, 128), input_shape, num_classes)


def resnet18_gn(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 with GroupNorm (min(32, C) groups) instead of BatchNorm, a stem for
    small images (a 3x3 stride-1 first convolution, no max pooling) and no in-place operations:
    Opacus' per-sample-gradient hooks reject in-place ReLUs and residual additions."""
    from torchvision.models.resnet import BasicBlock, ResNet

    class Block(BasicBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            identity = x if self.downsample is None else self.downsample(x)
            out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
            return self.relu(out + identity)

    model = ResNet(Block, [2, 2, 2, 2], num_classes=num_classes, norm_layer=lambda c: nn.GroupNorm(min(32, c), c))
    model.conv1 = nn.Conv2d(input_shape[0], 64, 3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision inits convs
    model.maxpool = nn.Identity()
    for module in model.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = False
    return model


def mlp(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Flatten, dense 128 with ReLU, dense num_classes: a small model for fast tests."""
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, 128), nn.ReLU(), nn.Linear(128, num_classes))


_BUILDERS = {
    "cnn-mnist": cnn_mnist,
    "cnn-emnist": cnn_emnist,
    "cnn-cifar10": cnn_cifar10,
    "cnn-cifar10-dp2": cnn_cifar10_dp2,
    "resnet18-gn": resnet18_gn,
    "mlp": mlp,
}


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int, seed: int = 0) -> nn.Module:
    """Model `name` for inputs of shape (C, H, W), initialized from `seed` without touching the global RNG."""
    if name not in _BUILDERS:
        raise ValueError(f"model={name!r} is not one of: {', '.join(MODELS)}")
    shape = tuple(int(v) for v in input_shape)
    if len(shape) != 3:
        raise ValueError(f"input_shape={input_shape} must be (channels, height, width)")
    with torch.random.fork_rng(devices=[]):  # models are built on the CPU: only its RNG is used and restored
        torch.random.default_generator.manual_seed(seed)
        return _BUILDERS[name](shape, int(num_classes))


def head_parameter_names(model: nn.Module, head_prefix: str = "") -> list[str]:
    """Names (as in named_parameters) of the personal head: the last nn.Linear's parameters, or every
    parameter whose name starts with `head_prefix` when it is given."""
    names = [name for name, _ in model.named_parameters()]
    if head_prefix:
        head = [name for name in names if name.startswith(head_prefix)]
        if not head:
            prefixes = dict.fromkeys(name.split(".")[0] for name in names)
            raise ValueError(
                f"head_prefix={head_prefix!r} matches no parameter of the model; its top-level "
                f"prefixes are: {', '.join(prefixes)}"
            )
        return head
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not linears:
        raise ValueError("the model has no nn.Linear to use as its head: pass a head_prefix")
    name, module = linears[-1]
    return [f"{name}.{p}" if name else p for p, _ in module.named_parameters()]


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters of `model`."""
    return sum(p.numel() for p in model.parameters())


def split_state_keys(model: nn.Module, head_prefix: str = "") -> tuple[list[str], list[str]]:
    """(body keys, head keys) of `model.state_dict()`, each in state_dict order.

    The head is `head_parameter_names(model, head_prefix)`, plus any buffer under `head_prefix`;
    the body (the shared representation phi of DP2-FedSAM) is everything else and must not be empty.
    """
    head_params = set(head_parameter_names(model, head_prefix))
    keys = list(model.state_dict())
    head = [k for k in keys if k in head_params or (head_prefix and k.startswith(head_prefix))]
    body = [k for k in keys if k not in set(head)]
    if not body:
        raise ValueError(f"head_prefix={head_prefix!r} covers the whole model: nothing is left to share")
    return body, head
