# Only parsed when meta-virtualization (collection virtualization-layer) is in BBLAYERS: its
# containerd RPROVIDES virtual-containerd. Unconditionally, the recommendation would make
# `bitbake edgehub`, `-e`, `-n` and world fail for everyone without that layer (BitBake treats
# a recommendation nobody provides as an error, "Nothing RPROVIDES").
RRECOMMENDS:${PN} += "virtual-containerd"
