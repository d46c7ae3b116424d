"""The exercise1 networks on the Python side of `make bench` (bench/exercise1_reference.py):
the course's simple CNN, and torchvision's ResNet34, ResNet50 and VGG19.

ResNet34, ResNet50 and VGG19 come from torchvision when it is installed, and otherwise from the
copies below: torchvision's own code (torchvision/models/resnet.py and vgg.py, without the weights
machinery and the variants exercise1 does not use), with the same module names, so the same
`state_dict` keys and shapes, the same initialisation, and the same in-place ReLUs.
exercises/tests/bench_reference.rs checks whichever layout `build` returns against our var
stores, name by name and shape by shape.
"""
import json
import struct

import torch
from torch import nn
import torch.nn.functional as F

try:
    import torchvision  # optional
except ImportError:  # the project's virtualenv has none
    torchvision = None


class CourseCNN(nn.Module):
    """The course's simple CNN (common/src/models/cnn.rs): conv(C→50, k5) → maxpool2 → ReLU →
    conv(50→75, k5) → maxpool2 → ReLU → flatten → fc(→50) → ReLU → fc(→num_classes)."""

    def __init__(self, in_channels=3, num_classes=10, image_size=32):
        super().__init__()
        side = ((image_size - 4) // 2 - 4) // 2
        self.conv1 = nn.Conv2d(in_channels, 50, 5)
        self.conv2 = nn.Conv2d(50, 75, 5)
        self.fc1 = nn.Linear(75 * side * side, 50)
        self.fc2 = nn.Linear(50, num_classes)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


# ---- torchvision.models.resnet (BasicBlock, Bottleneck, ResNet), as in torchvision 0.2x ----

def conv3x3(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class Bottleneck(nn.Module):
    # torchvision's Bottleneck places the stride for downsampling at the 3x3 convolution
    # (conv2), while the original paper places it at the first 1x1 convolution (conv1):
    # "ResNet V1.5".
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        width = planes
        self.conv1 = conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = conv1x1(width, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        out = self.relu(out)
        out = self.conv3(out)
        out = self.bn3(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNet(nn.Module):
    def __init__(self, block, layers, num_classes=1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, block, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes))
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return x


# ---- torchvision.models.vgg (VGG, make_layers, configuration "E") ----

VGG19_CFG = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"]


def make_layers(cfg):
    layers = []
    in_channels = 3
    for v in cfg:
        if v == "M":
            layers += [nn.MaxPool2d(kernel_size=2, stride=2)]
        else:
            layers += [nn.Conv2d(in_channels, v, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            in_channels = v
    return nn.Sequential(*layers)


class VGG(nn.Module):
    def __init__(self, features, num_classes=1000, dropout=0.5):
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, num_classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.constant_(m.bias, 0)

    def forward(self, x):
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.classifier(x)
        return x


# torchvision's resnet34 and resnet50: (block, blocks per stage).
RESNETS = {"resnet34": (BasicBlock, [3, 4, 6, 3]), "resnet50": (Bottleneck, [3, 4, 6, 3])}


def build(model, num_classes, source="auto"):
    """(module, where its layout came from). `source`: auto (torchvision when installed),
    torchvision, or builtin (the copies above)."""
    if model == "cnn":
        return CourseCNN(num_classes=num_classes), "bench/vision_models.py"
    if source == "torchvision" and torchvision is None:
        raise SystemExit("error: --layouts torchvision, but torchvision is not installed")
    use_tv = torchvision is not None and source != "builtin"
    if model in RESNETS:
        if use_tv:
            return getattr(torchvision.models, model)(weights=None, num_classes=num_classes), f"torchvision {torchvision.__version__}"
        return ResNet(*RESNETS[model], num_classes=num_classes), "bench/vision_models.py"
    if model == "vgg19":
        if use_tv:
            return torchvision.models.vgg19(weights=None, num_classes=num_classes), f"torchvision {torchvision.__version__}"
        return VGG(make_layers(VGG19_CFG), num_classes=num_classes), "bench/vision_models.py"
    raise SystemExit(f"error: unknown model {model}")



# ---- Reading a .safetensors file without the safetensors package (the venv has none) ----

SAFETENSORS_DTYPES = {"F32": torch.float32, "F64": torch.float64, "I64": torch.int64}


def read_safetensors(path):
    """{name: tensor} of a .safetensors file: an 8-byte little-endian header length, a JSON
    header of {name: {dtype, shape, data_offsets}}, then the tensors' bytes."""
    with open(path, "rb") as f:
        data = f.read()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    body = bytearray(data[8 + header_len:])
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        flat = torch.frombuffer(body, dtype=dtype, count=(end - start) // dtype.itemsize, offset=start) if end > start else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(info["shape"]).clone()
    return tensors
