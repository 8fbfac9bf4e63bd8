"""dpfl's Flower apps and their wiring."""

PROJECT_PACKAGES = (
    "dpcore",
    "fl_app",
    "strategies",
    "clients",
)  # this repository's packages: the apps' code, what the FAB holds
