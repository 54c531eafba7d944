// Declaration-only stand-in (see ../README.md). ProcessGroupGloo.hpp names nothing from here.
#pragma once
