#!/usr/bin/env python3
"""Makes the font the training-curves PNG is labelled with: DejaVu Sans cut down to printable ASCII.

Usage: python3 scripts/subset-font.py DejaVuSans.ttf accelerate-core/src/tracking/fonts/DejaVuSans-ASCII.ttf

The source is DejaVu Sans (https://dejavu-fonts.github.io/; Debian's fonts-dejavu-core has it);
the subset keeps the glyphs of U+0020..U+007E, about 20 KB instead of 750 KB, which is all the
plot's labels (metric names, numbers) use. Needs fontTools (`pip install fonttools`).
"""
import sys

from fontTools import subset

if len(sys.argv) != 3:
    sys.exit(__doc__)
source, target = sys.argv[1], sys.argv[2]
subset.main([
    source,
    "--unicodes=U+0020-007E",
    "--layout-features=kern",
    "--no-hinting",
    "--drop-tables+=FFTM,GDEF,GPOS,GSUB",
    f"--output-file={target}",
])
