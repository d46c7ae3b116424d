#!/usr/bin/env bash
# Puts WikiText-2 (the word-level release the course's Transformer exercise uses) under
# data/wikitext-2/.
#
# Where a network exists, downloads the official wikitext-2-v1.zip (from the first address
# below that serves it), verifies the MD5 that
# torchtext checks, and unpacks it (as data/wikitext-2/wikitext-2/wiki.{train,valid,test}.tokens,
# which the loader finds). Where it cannot, generates a stand-in in the same text format
# (marked by a GENERATED.txt file, and announced by every run that uses it).
#
#   scripts/fetch_wikitext.sh
# Needs PREPARE_DATA=path/to/prepare_data (the Makefile passes it).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
data="${DATA_DIR:-$root/data}"
prepare="${PREPARE_DATA:?set PREPARE_DATA to the prepare_data binary}"
dir="$data/wikitext-2"

# Sources, tried in order, and the checksum; the FETCH_* overrides (a space-separated list of
# addresses) exist for mirrors and for the tests. The dataset's author serves the original zip
# at wikitext.smerity.com; Salesforce's S3 bucket, its first home and torchtext's address,
# answers 403 since 2024 (pytorch/text#2233, #2255) and stays last in case it returns.
WIKITEXT_URLS="${FETCH_WIKITEXT_URL:-https://wikitext.smerity.com/wikitext-2-v1.zip https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-2-v1.zip}"
WIKITEXT_MD5="${FETCH_WIKITEXT_MD5:-542ccefacc6c27f945fb54453812b3cd}"

source "$root/scripts/lib/fetch.sh"

# unpack ZIP DIR: `unzip` where installed, else Python's zipfile (one of them is everywhere).
unpack() {
    local zip=$1 to=$2
    if command -v unzip >/dev/null; then
        unzip -q -o "$zip" -d "$to"
    else
        python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$zip" "$to"
    fi
}

fallback() {
    announce_generated WikiText-2 perplexities
    rm -rf "${dir:?}"
    "$prepare" generate-text --out "$dir" && "$prepare" check-text --dir "$dir"
}

if "$prepare" check-text --dir "$dir" 2>/dev/null; then exit 0; fi
mkdir -p "$dir"
zip="$dir/wikitext-2-v1.zip"
if download_first "$WIKITEXT_URLS" "$zip" "$WIKITEXT_MD5" && unpack "$zip" "$dir" && rm -f "$zip"; then
    "$prepare" check-text --dir "$dir"
else
    fallback
fi
