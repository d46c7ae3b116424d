# Shared by the data scripts (sourced, not run).

# download URL FILE MD5: fetch to FILE and verify its MD5; non-zero on any failure, nothing
# left behind.
download() {
    local url=$1 file=$2 md5=$3
    echo ">> downloading $url"
    curl -fsSL --connect-timeout 10 --max-time 1800 -o "$file.part" "$url" || { rm -f "$file.part"; return 1; }
    local got; got=$(md5sum "$file.part" | cut -d' ' -f1)
    if [[ "$got" != "$md5" ]]; then
        echo "!! $url: MD5 $got, expected $md5; discarding" >&2
        rm -f "$file.part"; return 1
    fi
    mv "$file.part" "$file"
}

# download_first "URL..." FILE MD5: the URLs (space-separated) tried in turn until one gives a
# file with that MD5; says which failed. Non-zero when none did.
download_first() {
    local urls=$1 file=$2 md5=$3 url
    for url in $urls; do
        download "$url" "$file" "$md5" && return 0
        echo "!! $url: not available (trying the next address, if any)" >&2
    done
    return 1
}

# announce_generated NAME FIGURES: the loud banner before a stand-in is generated.
announce_generated() {
    echo "!!" >&2
    echo "!! $1 could not be downloaded here (no network?): GENERATING a stand-in in the same" >&2
    echo "!! format instead. Runs on it say so; their $2 are not the course's." >&2
    echo "!!" >&2
}
