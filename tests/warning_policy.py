"""The warning policy of the tests that run a method end to end with warnings as errors (a run prints no
warning, fedapp's or a library's): an unraisable-exception warning is exempt, since it is the garbage
collector closing a file that earlier code leaked (Ray's /dev/null handles, measured) at whatever moment
it happens to run, not something the run under test printed. Put the mark after (list) or above
(decorators) the "error" one: that order wins."""

GC_OF_EARLIER_LEAKS = "ignore::pytest.PytestUnraisableExceptionWarning"
