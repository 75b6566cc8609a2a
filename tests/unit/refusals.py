"""The refusal check the feature unit tests share: a feature asked for refuses in one line naming the flags."""

import pytest

from mm_adaptor.core.features import FeatureConfigError, get


def assert_refused_in_one_line(feature_name: str, opts, names, why_enabled: str = "") -> None:
    feature = get(feature_name)
    assert feature.is_enabled(opts), why_enabled
    with pytest.raises(FeatureConfigError) as error:
        feature.validate(opts)
    message = str(error.value)
    assert "\n" not in message
    for name in names:
        assert name in message, message
