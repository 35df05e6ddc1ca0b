SUMMARY = "edgehub: offline OTA upgrades for Kubernetes DaemonSet pods"
DESCRIPTION = "Node agent that caches its node's pods, DaemonSets and ControllerRevisions, \
serves OpenYurt's OTA API on 127.0.0.1:10267, and upgrades pods through the CRI with or \
without a link to the cloud."
LICENSE = "Apache-2.0"
LIC_FILES_CHKSUM = "file://Cargo.toml;beginline=7;endline=7;md5=2507bd5f0713f05419cd2f22fa06fe62"

# Where the edgehub sources and the crate registry are, set in local.conf (see the layer's
# README): EDGEHUB_GIT_URI as host/path of the git repository, EDGEHUB_CRATE_REGISTRY as the
# host of the crate registry or of your mirror of it.
EDGEHUB_GIT_URI ??= ""
EDGEHUB_GIT_PROTOCOL ??= "https"
EDGEHUB_GIT_BRANCH ??= "main"
EDGEHUB_SRCREV ??= "${AUTOREV}"
EDGEHUB_CRATE_REGISTRY ??= ""

SRC_URI = "git://${EDGEHUB_GIT_URI};protocol=${EDGEHUB_GIT_PROTOCOL};branch=${EDGEHUB_GIT_BRANCH}"
SRCREV = "${EDGEHUB_SRCREV}"
S = "${WORKDIR}/git"

require edgehub-crates.inc

inherit cargo systemd

python () {
    for var in ("EDGEHUB_GIT_URI", "EDGEHUB_CRATE_REGISTRY"):
        if not d.getVar(var):
            bb.fatal("meta-edgehub: set %s in local.conf (see the layer's README)" % var)
}

# Only the device binary: the workspace also holds test support.
do_compile() {
    oe_cargo_build -p edgehub --bin edgehub
}

do_install:append() {
    install -d -m 0755 ${D}${sysconfdir}/edgehub
    install -m 0644 ${S}/yocto/meta-edgehub/recipes-core/edgehub/files/config.toml ${D}${sysconfdir}/edgehub/config.toml
    install -d -m 0700 ${D}${localstatedir}/lib/edgehub
    install -d ${D}${systemd_system_unitdir}
    install -m 0644 ${S}/yocto/meta-edgehub/recipes-core/edgehub/files/edgehub.service ${D}${systemd_system_unitdir}/edgehub.service
    install -d ${D}${docdir}/edgehub
    install -m 0644 ${S}/README.md ${S}/deploy/rbac.yaml ${S}/deploy/kubeconfig.template.yaml ${D}${docdir}/edgehub/
}

SYSTEMD_SERVICE:${PN} = "edgehub.service"
SYSTEMD_AUTO_ENABLE:${PN} = "enable"
FILES:${PN} += "${localstatedir}/lib/edgehub ${systemd_system_unitdir}/edgehub.service"
CONFFILES:${PN} = "${sysconfdir}/edgehub/config.toml"
# The CRI runtime edgehub drives (meta-virtualization's containerd).
RRECOMMENDS:${PN} = "containerd-opencontainers"
