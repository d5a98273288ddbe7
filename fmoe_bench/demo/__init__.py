"""The demo model's trainer (train.py), its corpus (data.py), its routing analysis (analysis.py) and loss plot
(report.py): scripts run by hand (fmoe_local/demo/weights/TRAINING.md); the weights they wrote stay in
fmoe_local/demo/weights/, where the app finds them."""
