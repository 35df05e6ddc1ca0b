SUMMARY = "edgehub: offline OTA upgrades for Kubernetes DaemonSet pods"
DESCRIPTION = "Node agent that caches its node's pods, DaemonSets and ControllerRevisions, \
serves OpenYurt's OTA API on 127.0.0.1:10267, and upgrades pods through the CRI with or \
without a link to the cloud."
SECTION = "admin"

# LICENSE and LIC_FILES_CHKSUM: edgehub's own licence and those of the crates linked into the
# binary, generated from cargo's view of the dependency graph.
require edgehub-licenses.inc

# Where the edgehub sources are, set in local.conf, a bbappend or the kas file (see the layer's
# README). Nothing is looked up at parse time: the recipe builds the commit it is given.
#   EDGEHUB_GIT_URI       host/path of the git repository (a local path with protocol "file")
#   EDGEHUB_GIT_PROTOCOL  the git fetcher's protocol: https (default), ssh, file
#   EDGEHUB_GIT_BRANCH    the branch the commit is on; empty for a commit on no branch
#   EDGEHUB_SRCREV        the full commit to build
EDGEHUB_GIT_URI ??= ""
EDGEHUB_GIT_PROTOCOL ??= "https"
EDGEHUB_GIT_BRANCH ??= "main"
EDGEHUB_SRCREV ??= ""

EDGEHUB_GIT_BRANCH_PARAM = "${@'branch=' + d.getVar('EDGEHUB_GIT_BRANCH') if d.getVar('EDGEHUB_GIT_BRANCH') else 'nobranch=1'}"
SRC_URI = "git://${EDGEHUB_GIT_URI};protocol=${EDGEHUB_GIT_PROTOCOL};${EDGEHUB_GIT_BRANCH_PARAM} \
           file://edgehub.service \
           file://config.toml \
           file://bootstrap-kubeconfig \
"
SRCREV = "${EDGEHUB_SRCREV}"
# "+git": the package version then carries the commit (0.1.0+git<n>+<hash>), so builds of
# different commits are different versions; with a PR service (PRSERV_HOST) <n> also orders them.
PV = "0.1.0+git"

# The crates of Cargo.lock, as `bitbake -c update_crates edgehub` writes them.
require ${BPN}-crates.inc

inherit cargo cargo-update-recipe-crates systemd

# The OTA managers' integrations (the repository's integrations/, docs/mender.md and
# docs/swupdate.md), installed when a firmware team asks for them:
#   PACKAGECONFIG:append:pn-edgehub = " mender"    Mender's Update Module for edgehub payloads,
#                                                  ${datadir}/mender/modules/v3/edgehub
#   PACKAGECONFIG:append:pn-edgehub = " swupdate"  the SWUpdate handler's device side,
#                                                  ${libexecdir}/edgehub/edgehub-swupdate
# Neither depends on a manager's layer: the image brings Mender or SWUpdate itself.
PACKAGECONFIG ??= ""
PACKAGECONFIG[mender] = ""
PACKAGECONFIG[swupdate] = ""

# A recipe that cannot be built skips itself with the reason, so adding the layer before
# configuring it breaks nobody's parse or world build.
python () {
    missing = [v for v in ("EDGEHUB_GIT_URI", "EDGEHUB_SRCREV") if not d.getVar(v)]
    if missing:
        raise bb.parse.SkipRecipe("set %s in local.conf (see meta-edgehub's README)" % " and ".join(missing))
}

# Only the device binary: the workspace also holds test support.
do_compile() {
    oe_cargo_build -p edgehub --bin edgehub
}

# The unit and the default config come from the layer's files/ (SRC_URI above), so a product
# layer overrides them the usual way: a bbappend with FILESEXTRAPATHS:prepend.
do_install:append() {
    install -d -m 0755 ${D}${sysconfdir}/edgehub
    install -m 0644 ${UNPACKDIR}/config.toml ${D}${sysconfdir}/edgehub/config.toml
    # The fleet-wide bootstrap kubeconfig; each device's key and certificate are made on the
    # device, in identity/ under the data dir (docs/identity.md).
    install -m 0644 ${UNPACKDIR}/bootstrap-kubeconfig ${D}${sysconfdir}/edgehub/bootstrap-kubeconfig
    install -d -m 0700 ${D}${localstatedir}/lib/edgehub
    install -d -m 0700 ${D}${localstatedir}/lib/edgehub/identity
    install -d ${D}${systemd_system_unitdir}
    install -m 0644 ${UNPACKDIR}/edgehub.service ${D}${systemd_system_unitdir}/edgehub.service
    install -d ${D}${docdir}/edgehub
    install -m 0644 ${S}/README.md ${S}/deploy/rbac.yaml ${S}/deploy/kubeconfig.template.yaml ${D}${docdir}/edgehub/
    # The README links into docs/, so the pages keep that path beside it.
    install -d ${D}${docdir}/edgehub/docs
    install -m 0644 ${S}/docs/*.md ${S}/docs/openapi.yaml ${D}${docdir}/edgehub/docs/
    if ${@bb.utils.contains('PACKAGECONFIG', 'mender', 'true', 'false', d)}; then
        install -d ${D}${datadir}/mender/modules/v3
        install -m 0755 ${S}/integrations/mender/edgehub ${D}${datadir}/mender/modules/v3/edgehub
    fi
    if ${@bb.utils.contains('PACKAGECONFIG', 'swupdate', 'true', 'false', d)}; then
        install -d ${D}${libexecdir}/edgehub
        install -m 0755 ${S}/integrations/swupdate/edgehub-swupdate ${D}${libexecdir}/edgehub/edgehub-swupdate
    fi
}

SYSTEMD_SERVICE:${PN} = "edgehub.service"
SYSTEMD_AUTO_ENABLE:${PN} = "enable"
FILES:${PN} += "${localstatedir}/lib/edgehub ${systemd_system_unitdir}/edgehub.service \
                ${datadir}/mender/modules/v3/edgehub ${libexecdir}/edgehub/edgehub-swupdate"
CONFFILES:${PN} = "${sysconfdir}/edgehub/config.toml ${sysconfdir}/edgehub/bootstrap-kubeconfig"
# The recommendation of a CRI runtime (meta-virtualization's containerd) is in
# dynamic-layers/virtualization-layer, parsed only when that layer is present.
