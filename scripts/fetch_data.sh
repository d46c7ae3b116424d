#!/usr/bin/env bash
# `make data`: puts CIFAR-10 (binary version) and MNIST under data/.
#
# Where a network exists, downloads the official archives and verifies their published
# MD5 checksums. Where it cannot, generates a stand-in in the same binary format (marked by a
# GENERATED.txt file, and announced by every run that uses it).
#
#   scripts/fetch_data.sh [cifar10|mnist ...]     (default: both)
# Needs PREPARE_DATA=path/to/prepare_data (the Makefile passes it).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
data="${DATA_DIR:-$root/data}"
prepare="${PREPARE_DATA:?set PREPARE_DATA to the prepare_data binary}"

# Sources, tried in order, and checksums; the FETCH_* overrides (a space-separated list of
# addresses) exist for mirrors and for the tests. CIFAR-10: its authors' page, the one address
# torchvision uses. MNIST: PyTorch's copy, which torchvision uses alone since yann.lecun.com
# began to answer 403/404 (pytorch/vision#8568, pytorch/pytorch#164238); the original last.
CIFAR_URLS="${FETCH_CIFAR_URL:-https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz}"
CIFAR_MD5="${FETCH_CIFAR_MD5:-c32a1d4ab5d03f1284b67883e8d87530}"
MNIST_URLS="${FETCH_MNIST_URL:-https://ossci-datasets.s3.amazonaws.com/mnist http://yann.lecun.com/exdb/mnist}"
declare -A MNIST_MD5=(
    [train-images-idx3-ubyte.gz]=f68b3c2dcbeaaa9fbdd348bbdeb94873
    [train-labels-idx1-ubyte.gz]=d53e105ee54ea40749a09fcbcd1e9432
    [t10k-images-idx3-ubyte.gz]=9fb629c4189551a2d022fa330f9573f3
    [t10k-labels-idx1-ubyte.gz]=ec29112dd5afa0611ce80d1b7f02629c
)

source "$root/scripts/lib/fetch.sh"

fallback() {
    local name=$1
    announce_generated "$name" accuracies
    rm -rf "${data:?}/$name"
    "$prepare" generate --dataset "$name" --out "$data/$name" && "$prepare" check --dataset "$name" --dir "$data/$name"
}

get_cifar10() {
    local dir="$data/cifar10"
    if "$prepare" check --dataset cifar10 --dir "$dir" 2>/dev/null; then return 0; fi
    mkdir -p "$dir"
    if download_first "$CIFAR_URLS" "$dir/cifar-10-binary.tar.gz" "$CIFAR_MD5" \
        && tar -xzf "$dir/cifar-10-binary.tar.gz" -C "$dir" && rm -f "$dir/cifar-10-binary.tar.gz"; then
        "$prepare" check --dataset cifar10 --dir "$dir"
    else
        fallback cifar10
    fi
}

get_mnist() {
    local dir="$data/mnist" ok=1
    if "$prepare" check --dataset mnist --dir "$dir" 2>/dev/null; then return 0; fi
    mkdir -p "$dir"
    for f in "${!MNIST_MD5[@]}"; do
        download_first "$(printf '%s/'"$f"' ' $MNIST_URLS)" "$dir/$f" "${MNIST_MD5[$f]}" || { ok=0; break; }
    done
    if [[ $ok == 1 ]]; then "$prepare" check --dataset mnist --dir "$dir"; else fallback mnist; fi
}

for name in "${@:-cifar10 mnist}"; do
    for n in $name; do
        case "$n" in
            cifar10) get_cifar10 ;;
            mnist) get_mnist ;;
            *) echo "error: unknown data set '$n' (cifar10, mnist)" >&2; exit 2 ;;
        esac || exit 1
    done
done
