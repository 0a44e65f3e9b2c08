"""What people read and jobs load: exporters (DeepSpeed JSON, Transformers, Accelerate, Lightning,
PEFT, YAML), the console tables and progress, the HTML report. Sits on top of the data flow: may
import any folder; only the CLI and the public API import it.
"""
