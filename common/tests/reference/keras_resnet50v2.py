"""Keras's own ResNet50V2 (the Namal/BSC course's model), its weights in our names.

    keras_resnet50v2.py DIR OUT.npz

Builds `keras.applications.ResNet50V2(weights=None, input_shape=(64, 64, 3), classes=10)` on
Keras's PyTorch backend (seeded; batch-norm scales, shifts and statistics drawn away from their
initial 1 and 0, so that they matter), and writes its weights to DIR/resnet50v2.pth as
`torch.save(state_dict)` in our names: Keras's layer `conv2_block1_1_conv` is our module
`conv2_block1.1_conv`, its kernel (H, W, in, out) our weight (out, in, H, W), gamma/beta/moving
mean/moving variance our weight/bias/running_mean/running_var.
OUT.npz holds a seeded input `x` (2 × 3 × 64 × 64, NCHW), the logits in inference mode and in
training mode (batch statistics), the post-network batch norm's moving mean after that training
call, and Keras's parameter counts: `trainable` and `total` (which counts the batch norms'
moving statistics) for 10 classes, `total_1000` for ImageNet's 1000.
"""
import os
import re
import sys

os.environ["KERAS_BACKEND"] = "torch"
import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

folder, out = sys.argv[1:3]
keras.utils.set_random_seed(0)
model = keras.applications.ResNet50V2(weights=None, input_shape=(64, 64, 3), classes=10, classifier_activation=None)
for layer in model.layers:
    if isinstance(layer, keras.layers.BatchNormalization):
        channels = layer.gamma.shape[0]
        layer.gamma.assign(np.random.uniform(0.5, 1.5, channels).astype("float32"))
        layer.beta.assign(np.random.uniform(-0.1, 0.1, channels).astype("float32"))
        layer.moving_mean.assign(np.random.uniform(-0.1, 0.1, channels).astype("float32"))
        layer.moving_variance.assign(np.random.uniform(0.5, 1.5, channels).astype("float32"))


def module_path(layer_name):
    """conv2_block1_1_conv -> conv2_block1.1_conv; conv1_conv, post_bn, predictions as they are."""
    block = re.match(r"(conv\d_block\d+)_(.+)", layer_name)
    return f"{block[1]}.{block[2]}" if block else layer_name


RENAME = {"kernel": "weight", "bias": "bias", "gamma": "weight", "beta": "bias", "moving_mean": "running_mean", "moving_variance": "running_var"}
state = {}
for layer in model.layers:
    for weight in layer.weights:
        kind = weight.path.split("/")[-1]
        value = torch.tensor(np.array(weight.numpy()))
        if kind == "kernel":
            value = value.permute(3, 2, 0, 1) if value.dim() == 4 else value.t()
        state[f"{module_path(layer.name)}.{RENAME[kind]}"] = value.contiguous()
torch.save(state, os.path.join(folder, "resnet50v2.pth"))

torch.manual_seed(0)
x = torch.randn(2, 3, 64, 64)
nhwc = x.permute(0, 2, 3, 1).numpy()
logits_eval = np.array(keras.ops.convert_to_numpy(model(nhwc, training=False)))
logits_train = np.array(keras.ops.convert_to_numpy(model(nhwc, training=True)))
post_mean = np.array(model.get_layer("post_bn").moving_mean.numpy())
trainable = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
imagenet = keras.applications.ResNet50V2(weights=None, classes=1000)
np.savez(
    out,
    x=x.numpy(),
    logits_eval=logits_eval,
    logits_train=logits_train,
    post_mean=post_mean,
    trainable=np.array(trainable, dtype=np.int64),
    total=np.array(model.count_params(), dtype=np.int64),
    total_1000=np.array(imagenet.count_params(), dtype=np.int64),
)
