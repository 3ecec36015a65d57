"""The one error type of checkpoint conversion."""

from stabledrl_mcore.common.errors import UserError


class ConversionError(UserError, ValueError):
    """A checkpoint or config that cannot be converted as given.

    The message names the offending tensor, config field or path, and says
    what was expected. Raised before anything is written whenever possible;
    a conversion that fails later leaves only a ``.tmp-*`` directory behind.
    """
