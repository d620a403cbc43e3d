//! The attribution methods: one list ([`Method::ALL`]) that `attribute`'s `--method`, its JSON,
//! `faithfulness`'s rankings, columns and JSON keys all follow.

use serde::{Serialize, Serializer};

/// An attribution method.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// `‖∂f/∂x_i‖₂`.
    Gradient,
    /// `∂f/∂x_i · x_i`.
    GradXInput,
    /// Integrated gradients from the zero embedding, midpoint rule.
    IntegratedGradients,
    /// `Σ_l mean_h (∂f/∂A ⊙ A)⁺` on the last query's row (Chefer et al. 2021).
    AttentionXGradient,
    /// `f(text) − f(text without token i)`.
    Occlusion,
    /// AttnLRP's relevance of the target's logit (Achtibat et al. 2024).
    #[serde(rename = "attnlrp")]
    AttnLrp,
    /// Value zeroing's mixing into the last position, rolled out (Mohebbi et al. 2023).
    ValueZeroing,
    /// ALTI-Logit's decomposition of the target's logit (Ferrando et al. 2023).
    AltiLogit,
}

impl Method {
    /// Every method, in the order the help lists them.
    pub const ALL: [Method; 8] = [
        Method::Gradient,
        Method::GradXInput,
        Method::IntegratedGradients,
        Method::AttentionXGradient,
        Method::AttnLrp,
        Method::ValueZeroing,
        Method::AltiLogit,
        Method::Occlusion,
    ];

    /// The name on the command line and in `attribute`'s JSON.
    pub fn name(self) -> &'static str {
        match self {
            Method::Gradient => "gradient",
            Method::GradXInput => "grad-x-input",
            Method::IntegratedGradients => "integrated-gradients",
            Method::AttentionXGradient => "attention-x-gradient",
            Method::Occlusion => "occlusion",
            Method::AttnLrp => "attnlrp",
            Method::ValueZeroing => "value-zeroing",
            Method::AltiLogit => "alti-logit",
        }
    }
    /// The key of its score in `faithfulness`'s JSON (a token row's field and a ranking's name):
    /// the name with `_` for `-`.
    pub fn key(self) -> String {
        self.name().replace('-', "_")
    }

    /// Its column's heading in `faithfulness`'s table.
    pub fn column(self) -> &'static str {
        match self {
            Method::Gradient => "‖grad‖",
            Method::GradXInput => "grad×x",
            Method::IntegratedGradients => "IG",
            Method::AttentionXGradient => "attn×grad",
            Method::Occlusion => "occlusion",
            Method::AttnLrp => "AttnLRP",
            Method::ValueZeroing => "VZ",
            Method::AltiLogit => "ALTI-logit",
        }
    }

    /// Whether `faithfulness` ranks by it: every method but occlusion, which is what the
    /// rankings are measured against.
    pub fn ranked_by_faithfulness(self) -> bool {
        self != Method::Occlusion
    }

    /// How its score is formed (`attribute`'s `definition`).
    pub fn definition(self) -> &'static str {
        match self {

            Method::Gradient => "‖∂f/∂x_i‖₂ over the embedding width",
            Method::GradXInput => "Σ_d ∂f/∂x_{i,d} · x_{i,d}",
            Method::IntegratedGradients => {
                "Σ_d x_{i,d} · mean_k ∂f/∂x_{i,d}((k+½)/steps · x), from the zero embedding"
            }
            Method::AttentionXGradient => {
                "Σ_layers mean_heads max(0, ∂f/∂A · A) on the last query's row of each pattern A"
            }
            Method::Occlusion => "f(text) − f(text without token i)",
            Method::AttnLrp => {
                "Σ_d x_{i,d} · g_{i,d}, g the backward of f = the target's logit under AttnLRP's rules"
            }
            Method::ValueZeroing => {
                "the last row of the rollout of C[l]_{i,j} = cosine distance of i's layer output when j's values are zeroed, rows normalized (no target)"
            }
            Method::AltiLogit => {
                "Σ_l Δlogit^l_j (layer l's attention from source j onto the target's logit) carried to the input by ALTI's rollout"
            }
        }
    }
}

impl std::str::FromStr for Method {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Method::ALL
            .into_iter()
            .find(|m| m.name() == s || m.name().replace('-', "_") == s)
            .ok_or_else(|| {
                format!(
                    "unknown attribution method `{s}`; the methods are {}",
                    Method::ALL.map(Method::name).join(", ")
                )
            })
    }
}

/// One value per method, in the order they were put in (that of [`Method::ALL`] where they
/// come from it); serialized as a map from each method's [`Method::key`] to its value.
#[derive(Clone, Debug, PartialEq)]
pub struct ByMethod<T>(Vec<(Method, T)>);

impl<T> Default for ByMethod<T> {
    fn default() -> Self {
        ByMethod(Vec::new())
    }
}

impl<T> ByMethod<T> {
    /// Adds (or replaces) `m`'s value; a new method goes last.
    pub fn insert(&mut self, m: Method, value: T) {
        match self.0.iter_mut().find(|(k, _)| *k == m) {
            Some(slot) => slot.1 = value,
            None => self.0.push((m, value)),
        }
    }

    /// `m`'s value, if it has one.
    pub fn get(&self, m: Method) -> Option<&T> {
        self.0.iter().find(|(k, _)| *k == m).map(|(_, v)| v)
    }

    /// Every (method, value), in order.
    pub fn iter(&self) -> impl Iterator<Item = (Method, &T)> {
        self.0.iter().map(|(m, v)| (*m, v))
    }

    /// Each value mapped by `f`, same methods, same order.
    pub fn map<U>(&self, mut f: impl FnMut(&T) -> U) -> ByMethod<U> {
        ByMethod(self.0.iter().map(|(m, v)| (*m, f(v))).collect())
    }
}

impl<T: Serialize> Serialize for ByMethod<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(m, v)| (m.key(), v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_keys_are_the_names_with_underscores() {
        for m in Method::ALL {
            assert_eq!(m.name().parse::<Method>(), Ok(m));
            assert_eq!(m.key().parse::<Method>(), Ok(m));
            assert!(!m.key().contains('-'));
        }
        assert_eq!(Method::AttentionXGradient.key(), "attention_x_gradient");
        assert!("saliency".parse::<Method>().is_err());
    }

    #[test]
    fn methods_parse_by_name() {
        for m in Method::ALL {
            assert_eq!(m.name().parse::<Method>().unwrap(), m);
        }
        assert_eq!(
            "grad_x_input".parse::<Method>().unwrap(),
            Method::GradXInput
        );
        let e = "saliency".parse::<Method>().unwrap_err();
        assert!(
            e.contains("unknown") && e.contains("integrated-gradients"),
            "{e}"
        );
    }

    #[test]
    fn by_method_serializes_in_insertion_order() {
        let mut b = ByMethod::default();
        b.insert(Method::GradXInput, 2.0f32);
        b.insert(Method::Gradient, 1.0);
        b.insert(Method::GradXInput, 3.0);
        assert_eq!(
            serde_json::to_string(&b).unwrap(),
            r#"{"grad_x_input":3.0,"gradient":1.0}"#
        );
        assert_eq!(b.get(Method::Gradient), Some(&1.0));
        assert_eq!(b.get(Method::AltiLogit), None);
    }
}
