#!/usr/bin/env bash
# Regenerate the shipped offline profiling results of the default model (SmolLM2-135M-Instruct):
# the LIS swap-order profile, the MorphServe Table 8 comparison and its plot.
#
#   bash profiling/regenerate.sh
#
# Runs from the repository root whatever the current directory. Uses .venv/bin/elastic-hf when the project's
# virtual environment exists, else elastic-hf on PATH. The console shows everything (progress bars included);
# profiling/smollm2-135m-instruct/profile-log.txt gets the same output without the tqdm progress-bar updates
# (the per-k perplexity lines and the table are kept; --no-progress would hide the per-k lines too).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -x .venv/bin/elastic-hf ]]; then
    cli=.venv/bin/elastic-hf
else
    cli=elastic-hf
fi

out_dir=profiling/smollm2-135m-instruct
log="$out_dir/profile-log.txt"
mkdir -p "$out_dir"

# mawk reads its input in blocks unless told otherwise: ask it to read line by line so the log fills as it goes.
awk_flags=()
if awk -W version 2>/dev/null | grep -q mawk; then
    awk_flags=(-W interactive)
fi

# Unbuffered Python so stdout (results) and stderr (progress bars, warnings) keep their order in the log.
export PYTHONUNBUFFERED=1

{
    "$cli" profile --evaluate --eval-windows 32 \
        --out "$out_dir/lis-profile.json" \
        --plot "$out_dir/table8.png" 2>&1 \
        | tee /dev/fd/3 \
        | awk ${awk_flags[@]+"${awk_flags[@]}"} '
            # tqdm redraws its bar with carriage returns: keep every other text, drop the bar states.
            index($0, "\r") == 0 { print; fflush(); next }
            {
                n = split($0, parts, "\r")
                for (i = 1; i <= n; i++)
                    if (parts[i] != "" && parts[i] !~ /[0-9]+%\|/) print parts[i]
                fflush()
            }' > "$log"
} 3>&1
