"""Studies: drivers that are not campaign cells (`python -m experiments.studies.<name>`).

Every study writes its record through ledgers.studies, the module's TABLE naming its
study table (documented schema in STUDY_SCHEMAS, atomic write, audited by ledgers.check)
beside any campaign runs it makes, and has its page in analysis/studies/<name>.py. The
fits in CONFIG_FITS write configuration instead (conf/executor/, or print only) and no
study table.
"""

CONFIG_FITS = ("calibrate", "codec_fit")
